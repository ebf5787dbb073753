"""The tiny local model of tests and the CPU demo: `model` builds and caches it (a random-init
Qwen3 LM, a locally trained tokenizer), `chat_template` holds its ChatML tool templates. A leaf:
it imports nothing else of the package, so the backends may build it."""
