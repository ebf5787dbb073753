"""Moving tokens to and from the experts with gathers only: the megatron engine's MoE speed switch
`gather_dispatch` (`megatron.speed`), for the local spec.

megatron-core 0.19 without TransformerEngine permutes a layer's tokens into expert order with
`index_select` and restores them with `scatter_add_`, so the forward's restore and the backward of
the permutation are atomic adds into bf16 rows: every token's row receives its top-k copies one
atomic add at a time. Measured on an H200 (4 layers of Qwen3-30B-A3B's width, 64k tokens a
micro-batch, `gpu_mfu.py`): `index_add_` and `scatter_add_` took 55 ms of a 673 ms step, and this
module's gathers 18 ms; side by side, 104,324 tokens/s against megatron-core's 99,367.

Every token is routed to exactly k experts (dropless top-k routing, which is what this engine
runs), so the permutation has a known inverse shape: token t's k copies sit in k rows of the
expert-ordered tensor. `GatherDispatcher` keeps megatron-core's all-to-all dispatcher (the same
expert order, the same communication for EP > 1) and replaces its two local permutations with
`to_experts` / `from_experts`, whose forwards and backwards are all gathers:

- to experts: row p of the output is token `token_of[p]`; the backward sums each token's k rows
  (`rows_of[t]`, a [tokens, k] index) in one gather and one reduction;
- back from experts: token t's output is the sum of its k rows; the backward copies each token's
  gradient to its k rows (a gather by `token_of`).

The sums over k run in fp32 inside torch's reduction, where `scatter_add_` added in bf16 one row at
a time: the result equals megatron-core's up to bf16 rounding, not bit for bit.
"""

import functools

import torch


class _Regroup(torch.autograd.Function):
    """rows → rows gathered by `index` [n, k] and summed over k; the backward gathers the output's
    gradient by `back_index` [m, back_k] and sums over back_k (the transposed regroup)."""

    @staticmethod
    def forward(ctx, rows, index, back_index):
        ctx.save_for_backward(back_index)
        return _gather_sum(rows, index)

    @staticmethod
    def backward(ctx, grad):
        (back_index,) = ctx.saved_tensors
        return _gather_sum(grad, back_index), None, None


def _gather_sum(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows [m, h], index [n, k] → [n, h]: row i is the sum of rows[index[i, j]] over j."""
    n, k = index.shape
    picked = rows.index_select(0, index.reshape(-1))
    return picked if k == 1 else picked.view(n, k, rows.shape[-1]).sum(dim=1)


def expert_order(
    routing_map: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """routing_map bool [tokens, experts] with exactly `top_k` experts per token → (`order` int64
    [tokens · k]: each row's place in the expert-major flattened map, expert · tokens + token, in
    megatron-core `permute`'s order (by expert, tokens ascending within one); `token_of` int64
    [tokens · k, 1]: each row's token; `rows_of` int64 [tokens, k]: the rows holding each token's
    copies)."""
    tokens = routing_map.shape[0]
    order = routing_map.T.reshape(-1).argsort(descending=True, stable=True)[: tokens * top_k]
    token_of = order % tokens
    rows_of = token_of.argsort(stable=True).view(tokens, top_k)
    return order, token_of.unsqueeze(1), rows_of


def to_experts(tokens: torch.Tensor, token_of: torch.Tensor, rows_of: torch.Tensor) -> torch.Tensor:
    """tokens [t, h] → their copies in expert order [t · k, h]."""
    return _Regroup.apply(tokens, token_of, rows_of)


def from_experts(rows: torch.Tensor, token_of: torch.Tensor, rows_of: torch.Tensor) -> torch.Tensor:
    """The experts' outputs in expert order [t · k, h] → each token's sum of its k rows [t, h]."""
    return _Regroup.apply(rows, rows_of, token_of)


@functools.cache
def _dispatcher_class():
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    class GatherDispatcher(MoEAlltoAllTokenDispatcher):
        """megatron-core's all-to-all dispatcher with its two local permutations as
        `to_experts` / `from_experts` (module docstring), and without the sort by local expert
        where it is the identity (one rank: no EP, no TP); everything else (splits, the EP
        all-to-alls, that sort across ranks, the host syncs, shared experts) is the parent's."""

        def dispatch_preprocess(self, hidden_states, routing_map, probs):
            self.hidden_shape = hidden_states.shape
            self.probs, self.routing_map = probs, routing_map
            tokens = hidden_states.view(-1, self.hidden_shape[-1])
            self.tokens_per_expert = self.preprocess(routing_map)
            if self.shared_experts is not None:
                self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
            self.tokens_per_expert = self._maybe_dtoh_and_synchronize(
                "before_permutation_1", self.tokens_per_expert
            )
            self.hidden_shape_before_permute = tokens.shape
            order, token_of, rows_of = expert_order(routing_map, self.config.moe_router_topk)
            self.reversed_local_input_permutation_mapping = token_of.squeeze(1)
            self.expert_rows = (token_of, rows_of)
            permuted_probs = probs.T.reshape(-1)[order]
            return to_experts(tokens, token_of, rows_of), permuted_probs

        def dispatch_postprocess(self, global_input_tokens, global_probs):
            if self.tp_size * self.ep_size > 1:
                return super().dispatch_postprocess(global_input_tokens, global_probs)
            # One rank (no EP, no TP): its tokens arrive as one chunk per local expert, already in
            # local-expert order; the parent's sort by local expert would split and concatenate
            # them unchanged (a copy of every routed row, and another in the backward).
            self.tokens_per_expert = self._maybe_dtoh_and_synchronize(
                "before_permutation_2", self.tokens_per_expert
            )
            tokens_per_expert = self._maybe_dtoh_and_synchronize(
                "before_finish", self.tokens_per_expert
            )
            self.tokens_per_expert = None
            return global_input_tokens, tokens_per_expert, global_probs

        def combine_preprocess(self, hidden_states):
            if self.tp_size * self.ep_size > 1:
                return super().combine_preprocess(hidden_states)
            return hidden_states  # one rank: the unsort is the identity too (dispatch_postprocess)

        def combine_postprocess(self, permutated_local_input_tokens):
            token_of, rows_of = self.expert_rows
            output = from_experts(permutated_local_input_tokens, token_of, rows_of)
            output = output.view(self.hidden_shape)
            if self.shared_experts is not None:
                output = output + self.shared_experts.get_output()
            return output

    return GatherDispatcher


def why_not(config) -> str | None:
    """Why `gather_dispatch` cannot run with this megatron-core config (None: it can)."""
    for reason, applies in (
        ("it needs megatron-core's all-to-all token dispatcher",
         config.moe_token_dispatcher_type != "alltoall"),
        ("it needs dropless routing (moe_expert_capacity_factor unset)",
         config.moe_expert_capacity_factor is not None),
        ("it needs unpadded routing maps (moe_router_padding_for_quantization off)",
         config.moe_router_padding_for_quantization),
        ("TransformerEngine's fused permutation is on (moe_permute_fusion)",
         config.moe_permute_fusion),
    ):  # fmt: skip
        if applies:
            return reason
    return None


def use_gather_dispatch(model: torch.nn.Module) -> int:
    """Give every MoE layer of `model` the gather dispatcher; returns how many layers took it.
    Raises ValueError naming the reason where the config rules it out."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    for layer in layers:
        reason = why_not(layer.config)
        if reason is not None:
            raise ValueError(f"local.megatron.speed.gather_dispatch: {reason}; set it to false")
        if type(layer.token_dispatcher) is not MoEAlltoAllTokenDispatcher:
            raise ValueError(
                "local.megatron.speed.gather_dispatch: the layer's token dispatcher is "
                f"{type(layer.token_dispatcher).__name__}, not megatron-core's all-to-all one"
            )
        # the subclass adds no state: the built dispatcher (its groups, streams, shared-expert
        # hook) stays as megatron-core made it, only its two permutations change
        layer.token_dispatcher.__class__ = _dispatcher_class()
    return len(layers)
