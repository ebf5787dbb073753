"""The demo task family: calculator questions as Harbor tasks with a shipped stdio MCP server.

`generate_tasks(out_dir, n_train, n_eval, seed, n_demonstrations=0) -> TaskSplits` writes the task
directories (train, held-out, and the warm start's own);
`python -m oneloop.agents.demo_tasks.server` is the MCP server they declare; `verify.sh` is the
verifier every task ships as `tests/test.sh`; `demonstrations.write_demonstrations` writes
tasks' demonstrations as a chat-conversation JSONL (the demo preset's `sft.data: demo`).
"""

from oneloop.agents.demo_tasks.generator import (
    ANSWER_ENV_PATH,
    MCP_SERVER_NAME,
    DemoTask,
    Difficulty,
    Fault,
    Question,
    TaskSplits,
    generate_tasks,
    make_question,
    write_task,
)

__all__ = [
    "ANSWER_ENV_PATH",
    "MCP_SERVER_NAME",
    "DemoTask",
    "Difficulty",
    "Fault",
    "Question",
    "TaskSplits",
    "generate_tasks",
    "make_question",
    "write_task",
]
