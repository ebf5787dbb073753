"""The CPU demo: the local backend end to end on the tiny model, no GPU, no network.

Creates a LoRA training client on Ray, runs a few supervised (cross_entropy) steps on a fixed
tool-calling conversation, publishes the weights to the sampler (`inflight`), samples, and checks
the trainer's and the sampler's logprobs of the sampled tokens agree.
"""

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from tinker import types

from oneloop.backends import BackendConfig, connect
from oneloop.tiny_model import TINY_MODEL_NAME

CONVERSATION = [
    {"role": "user", "content": "What is 17 + 25?"},
    {"role": "assistant", "content": "The answer is 42."},
]


def sft_datum(tokens: list[int], prompt_len: int) -> types.Datum:
    """Next-token datum with weight 1 on the completion (after `prompt_len`) only."""
    weights = [0.0] * (prompt_len - 1) + [1.0] * (len(tokens) - prompt_len)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="oneloop demo")
    parser.add_argument("--steps", type=int, default=20, help="SFT steps")
    parser.add_argument("--run-dir", type=Path, default=None, help="checkpoint directory")
    args = parser.parse_args(argv)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="oneloop-demo-"))
    start = time.time()
    service = connect(BackendConfig(backend="local", run_dir=run_dir))
    trainer = service.create_lora_training_client(TINY_MODEL_NAME, rank=16, seed=0).result()
    tokenizer = trainer.get_tokenizer()
    prompt = tokenizer.apply_chat_template(
        CONVERSATION[:1], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    full = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    datum = sft_datum(list(full), len(prompt))
    for step in range(args.steps):
        fwd = trainer.forward_backward([datum] * 8, "cross_entropy")
        opt = trainer.optim_step(types.AdamParams(learning_rate=3e-3))
        loss = fwd.result().metrics["loss:sum"] / (8 * (len(full) - len(prompt)))
        opt.result()
        print(f"step {step:3d}  loss/token {loss:.4f}")
    sampler = trainer.save_weights_and_get_sampling_client(kind="inflight").result()
    params = types.SamplingParams(max_tokens=24, temperature=0.0, seed=0)
    out = sampler.sample(types.ModelInput.from_ints(list(prompt)), 1, params).result()
    seq = out.sequences[0]
    print("sampled:", repr(tokenizer.decode(seq.tokens)), f"({seq.stop_reason})")
    whole = list(prompt) + seq.tokens
    check = trainer.forward([sft_datum(whole, len(prompt))], "cross_entropy").result()
    trainer_lp = check.loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1 :]
    gap = float(np.abs(trainer_lp - np.asarray(seq.logprobs)).max())
    print(f"trainer-vs-sampler max |Δlogprob| = {gap:.2e}; {time.time() - start:.1f}s total")
    service.close()
    return 0
