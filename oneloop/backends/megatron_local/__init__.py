"""The `local` backend: Tinker's client surface on a Ray cluster of our own engines.

Megatron is one trainer engine of several: trainers `torch | megatron`, samplers `torch | vllm`
(`local.trainer_engine`, `local.sampler_engine`). Three layers; imports point down only:

- Front doors (Tinker's surface): `service_client.py` (LocalServiceClient), `training_client.py`,
  `sampling_client.py`; `serve/` puts the same service behind Tinker's HTTP protocol.
- Runtime: `actors.py` (Ray actors hosting the engines), `routing.py` (session-affine sampler
  pools), `publish.py` (trainer → sampler weight publication), `checkpoints.py` (`tinker://`
  paths, `CheckpointMeta`), `models.py` (model resolution), `lora_serving.py` (LoRA serving
  policy), `futures.py`, `sample_batch.py`.
- Engines: `engines/{torch,vllm,megatron}/` behind the contracts in `engines/base.py` (built by
  `engines/factory.py`); weight transfer between them in `weight_sync/` (layout, NCCL, CUDA IPC).

Leaf helpers any layer may use: `losses.py` (Tinker's loss definitions), `ports.py` (free ports).
"""
