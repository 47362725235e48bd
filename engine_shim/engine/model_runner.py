"""Turns a scheduled batch into tensors, runs the model over the paged cache, and returns
the logits of the sequences that caught up with their tokens (the ones that sample)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import AttnContext, SeqAttnInfo, build_decode_batch
from .config import ModelConfig
from .kv_cache import KVCache
from .model import CausalLM
from .scheduler import ScheduledSeq


@dataclass
class RunResult:
    # logits: [len(sampled_index), vocab] fp32, row i belongs to scheduled[sampled_index[i]]
    logits: torch.Tensor
    sampled_index: list[int]


class ModelRunner:
    def __init__(self, model: CausalLM, config: ModelConfig, kv_cache: KVCache, page_size: int):
        self.model = model
        self.config = config
        self.kv_cache = kv_cache
        self.page_size = page_size
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq], needs_logits: list[bool]) -> RunResult:
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        seq_infos: list[SeqAttnInfo] = []
        last_token_rows: list[int] = []
        sampled_index: list[int] = []
        for i, item in enumerate(batch):
            seq, begin = item.seq, item.seq.num_computed_tokens
            end = begin + item.num_tokens
            slots = self._slots(seq.block_table, end)  # [end]
            seq_infos.append(SeqAttnInfo(len(input_ids), item.num_tokens, end, slots))
            input_ids.extend(seq.token_ids[begin:end])
            positions.extend(range(begin, end))
            slot_mapping.extend(slots[begin:end].tolist())
            if needs_logits[i]:
                last_token_rows.append(len(input_ids) - 1)
                sampled_index.append(i)
        ctx = AttnContext(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=self.device),
            seqs=seq_infos,
            sliding_window=self.config.sliding_window,
        )
        if len(seq_infos) > 1 and all(s.q_len == 1 for s in seq_infos):
            ctx.decode = build_decode_batch(seq_infos, self.config.sliding_window)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            self.kv_cache.kv,
            ctx,
        )  # [T, H]
        if not last_token_rows:
            return RunResult(torch.empty(0, self.config.vocab_size), [])
        rows = torch.tensor(last_token_rows, dtype=torch.int64, device=self.device)
        logits = self.model.logits(hidden.index_select(0, rows)).to("cpu")
        return RunResult(logits, sampled_index)

    def _slots(self, block_table: list[int], num_positions: int) -> torch.Tensor:
        # position p -> table[p // page_size] * page_size + p % page_size; [num_positions]
        table = torch.tensor(block_table, dtype=torch.int64, device=self.device)
        pos = torch.arange(num_positions, dtype=torch.int64, device=self.device)
        return table[pos // self.page_size] * self.page_size + pos % self.page_size
