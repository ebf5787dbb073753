#!/bin/sh
# Verifier of the oneloop demo calculator tasks (Harbor runs it as /tests/test.sh).
# Reward 1 when the submitted answer (/logs/agent/answer.txt, written by the MCP server's
# submit_answer or by solution/solve.sh) equals /tests/expected_answer.txt as a number, else 0.
# A missing or non-numeric answer is a wrong answer (reward 0), never a missing reward.
expected=$(tr -d ' \t\r\n' < /tests/expected_answer.txt)
answer=""
if [ -f /logs/agent/answer.txt ]; then
  answer=$(head -c 200 /logs/agent/answer.txt | tr -d ' \t\r\n')
fi
mkdir -p /logs/verifier
if awk -v a="$answer" -v e="$expected" 'BEGIN {
  if (a !~ /^[-+]?[0-9]+(\.[0-9]*)?$/) exit 1
  exit !(a + 0 == e + 0)
}'; then
  echo 1 > /logs/verifier/reward.txt
  echo "correct: answer=$answer expected=$expected"
else
  echo 0 > /logs/verifier/reward.txt
  echo "wrong: answer='$answer' expected=$expected"
fi
