"""Turns a scheduled batch into tensors, runs the model over the paged cache, and returns
the logits of the sequences that caught up with their tokens (the ones that sample).

On CUDA a pure decode step (one token per sequence) takes a faster road: metadata built from
Python ints in one pass, the Triton paged-attention kernel, and a CUDA-graph replay when the
batch fits a captured bucket. Logits stay on the device; greedy rows are reduced to token ids
there and only rows that need full sampling are copied to the host.

A pure decode step may be fed (`Feed`): its input ids are an earlier step's argmax, still on
the device, so it can be launched before that step's tokens reach the host (the engine's
chain_decode). Such steps also keep their argmax on the device for the step after.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import triton_attention
from .attention import AttnContext, MixedDecode, PagedDecode, SeqAttnInfo, build_decode_batch
from .config import ModelConfig
from .cuda_graphs import DecodeGraphRunner, DecodeInputs, Feed, ReadBack
from .kv_cache import KVCache
from .mixed_graphs import MixedGraphRunner, MixedLayout
from .model import CausalLM
from .scheduler import ScheduledSeq
from .triton_prefill import PrefillRows, build_paged_prefill


@dataclass
class RunResult:
    # logits: [len(sampled_index), vocab] fp32 on the model's device; row i belongs to
    # scheduled[sampled_index[i]]
    logits: torch.Tensor
    sampled_index: list[int]
    argmax: torch.Tensor | None = None  # [rows] int64 on the device, when the step took it
    read_back: ReadBack | None = None  # argmax on its way to the host (graph replays)
    _greedy: dict[int, int] | None = None
    _host_rows: dict[int, torch.Tensor] | None = None

    def prepare(self, is_plain_greedy: list[bool]) -> None:
        """Argmax of the plain-greedy rows on the device, and one host copy of the others."""
        greedy_rows = [r for r, plain in enumerate(is_plain_greedy) if plain]
        other_rows = [r for r, plain in enumerate(is_plain_greedy) if not plain]
        self._greedy = {}
        if greedy_rows:
            if self.read_back is not None:  # already on its way: wait for it alone
                all_ids = self.read_back.tolist()
                ids = [all_ids[r] for r in greedy_rows]
            elif self.argmax is not None:  # one small read-back for every row
                all_ids = self.argmax.tolist()
                ids = [all_ids[r] for r in greedy_rows]
            else:
                ids = self.logits[greedy_rows].argmax(dim=-1).tolist()
            self._greedy = dict(zip(greedy_rows, ids, strict=True))
        self._host_rows = {}
        if other_rows:
            host = self.logits[other_rows].to("cpu")
            self._host_rows = {r: host[i] for i, r in enumerate(other_rows)}

    def greedy_token(self, row: int) -> int | None:
        return None if self._greedy is None else self._greedy.get(row)

    def host_logits(self, row: int) -> torch.Tensor:
        """[vocab] fp32 on the CPU."""
        if self._host_rows is not None and row in self._host_rows:
            return self._host_rows[row]
        return self.logits[row].to("cpu")


class ModelRunner:
    def __init__(
        self, model: CausalLM, config: ModelConfig, kv_cache: KVCache, page_size: int,
        paged_prefill: bool = True,
    ) -> None:
        self.model = model
        self.config = config
        self.kv_cache = kv_cache
        self.page_size = page_size
        self.device = next(model.parameters()).device
        # The Triton kernels (decode, prefill) cover full attention; sliding windows keep the
        # reference. On the CPU only under Triton's interpreter (the kernel tests).
        self.use_paged_kernels = (
            config.sliding_window is None and triton_attention.is_available(self.device)
        )
        self.use_paged_prefill = paged_prefill  # with use_paged_kernels
        self.graphs: DecodeGraphRunner | None = None
        self.mixed_graphs: MixedGraphRunner | None = None

    def capture_cuda_graphs(
        self, max_batch: int, max_context_length: int, max_prefill_tokens: int | None = None,
    ) -> None:
        """Capture decode graphs for batches up to max_batch (CUDA with the Triton kernel),
        and with max_prefill_tokens graphs of steps that prefill (mixed_graphs.py) for up to
        max_batch decode rows plus that many prompt tokens."""
        if not self.use_paged_kernels or self.device.type != "cuda":
            return
        max_pages = -(-max_context_length // self.page_size)
        runner = DecodeGraphRunner(
            self.model, self.kv_cache.kv, self.page_size, max_pages,
            self.kv_cache.scratch_slot, max_batch,
        )
        runner.capture()
        self.graphs = runner
        if max_prefill_tokens and self.use_paged_prefill:
            mixed = MixedGraphRunner(
                self.model, self.kv_cache.kv, self.page_size, self.kv_cache.scratch_slot,
                max_tokens=max_batch + max_prefill_tokens, max_decode_rows=max_batch,
                max_pages_per_seq=max_pages,
            )
            mixed.capture()
            self.mixed_graphs = mixed

    @torch.inference_mode()
    def run(
        self, batch: list[ScheduledSeq], needs_logits: list[bool], feed: Feed | None = None,
        keep_argmax: bool = False,
    ) -> RunResult:
        """feed: the input ids of a pure decode batch, on the device. keep_argmax: a pure
        decode batch whose every row samples returns its argmax on the device (RunResult.argmax),
        so a later step can be fed from it."""
        if feed is not None and not (_is_fed_decode(batch) and all(needs_logits)):
            raise ValueError("only a decode batch whose every row samples can be fed")
        if self.use_paged_kernels and (feed is not None or _is_pure_decode(batch)):
            return self._run_paged_decode(batch, needs_logits, feed)
        if self.use_paged_kernels and self.use_paged_prefill and feed is None:
            return self._run_mixed(batch, needs_logits)
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        seq_infos: list[SeqAttnInfo] = []
        last_token_rows: list[int] = []
        sampled_index: list[int] = []
        # The reference path (and CUDA with paged_prefill off): each prefilling sequence
        # through SDPA; on CUDA the decode rows of the step through the Triton decode kernel
        # in one launch.
        paged = self.use_paged_kernels and feed is None
        page_size = self.page_size
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        for i, item in enumerate(batch):
            seq, begin = item.seq, item.seq.num_computed_tokens
            end = begin + item.num_tokens
            table = seq.block_table
            if paged and item.num_tokens == 1 and begin > 0:
                decode_rows.append(len(input_ids))
                decode_tables.append(table)
                decode_lens.append(end)
                input_ids.append(seq.token_ids[begin])
                positions.append(begin)
                slot_mapping.append(table[begin // page_size] * page_size + begin % page_size)
            else:
                slots = self._slots(seq.block_table, end)  # [end]
                seq_infos.append(SeqAttnInfo(len(input_ids), item.num_tokens, end, slots))
                if feed is None:
                    input_ids.extend(seq.token_ids[begin:end])
                else:
                    input_ids.append(0)  # replaced by the fed id below
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
        if decode_rows:
            ctx.mixed_decode = self._mixed_decode(decode_rows, decode_tables, decode_lens)
        elif len(seq_infos) > 1 and all(s.q_len == 1 for s in seq_infos):
            ctx.decode = build_decode_batch(seq_infos, self.config.sliding_window)
        ids_t = (
            torch.tensor(input_ids, dtype=torch.int64, device=self.device) if feed is None
            else _fed_ids(feed, self.device)
        )
        hidden = self.model(
            ids_t,
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            self.kv_cache.kv,
            ctx,
        )  # [T, H]
        if not last_token_rows:
            return RunResult(torch.empty(0, self.config.vocab_size), [])
        rows = torch.tensor(last_token_rows, dtype=torch.int64, device=self.device)
        logits = self.model.logits(hidden.index_select(0, rows))
        keep = (feed is not None or keep_argmax) and len(sampled_index) == len(batch) and _is_fed_decode(batch)
        return RunResult(logits, sampled_index, logits.argmax(dim=-1) if keep else None)

    def _mixed_decode(
        self, rows: list[int], tables: list[list[int]], lens: list[int]
    ) -> MixedDecode:
        width = max(len(table) for table in tables)
        padded = [table + [0] * (width - len(table)) for table in tables]
        return MixedDecode(
            torch.tensor(rows, dtype=torch.int64, device=self.device),
            PagedDecode(torch.tensor(padded, dtype=torch.int32, device=self.device),
                        torch.tensor(lens, dtype=torch.int32, device=self.device),
                        self.page_size))

    def _run_mixed(self, batch: list[ScheduledSeq], needs_logits: list[bool]) -> RunResult:
        """A step that prefills, on the paged kernels: laid out decode rows first, replayed
        from a captured graph when one fits (mixed_graphs.py), otherwise run eagerly (the
        decode rows through the decode kernel in one launch, every prefilling sequence
        through the prefill kernel in another). Slots are computed on the host."""
        step = self.layout_mixed(batch, needs_logits)
        sampled_index = [i for i, needed in enumerate(needs_logits) if needed]
        graphs = self.mixed_graphs
        if graphs is not None and graphs.fits(step):
            sampled = graphs.run(step)  # [len(sample_rows), H]
        else:
            sampled = self._forward_mixed_eagerly(step)
        if not step.sample_rows:
            return RunResult(torch.empty(0, self.config.vocab_size), [])
        return RunResult(self.model.logits(sampled), sampled_index)

    def _forward_mixed_eagerly(self, step: MixedLayout) -> torch.Tensor:
        """The hidden states of the step's sample rows, the decode rows through the decode
        kernel in one launch and every prefilling sequence through the prefill kernel."""
        device = self.device
        ctx = AttnContext(
            slot_mapping=torch.tensor(step.slot_mapping, dtype=torch.int64, device=device), seqs=[],
        )
        num_decode = len(step.decode_lens)
        if num_decode:
            ctx.mixed_decode = self._mixed_decode(list(range(num_decode)), step.decode_tables, step.decode_lens)
        if step.prefills:
            ctx.paged_prefill = build_paged_prefill(step.prefills, self.page_size, device)
        hidden = self.model(
            torch.tensor(step.input_ids, dtype=torch.int64, device=device),
            torch.tensor(step.positions, dtype=torch.int64, device=device),
            self.kv_cache.kv, ctx,
        )
        return hidden.index_select(0, torch.tensor(step.sample_rows, dtype=torch.int64, device=device))

    def layout_mixed(self, batch: list[ScheduledSeq], needs_logits: list[bool]) -> MixedLayout:
        """The step's host metadata, decode rows (one new token at a position > 0) first,
        then each other sequence's rows; sample_rows in batch order of the rows that sample."""
        page_size = self.page_size
        decode = [i for i, item in enumerate(batch) if item.num_tokens == 1 and item.seq.num_computed_tokens > 0]
        is_decode = set(decode)
        order = decode + [i for i in range(len(batch)) if i not in is_decode]
        step = MixedLayout([], [], [], [], [], [], [])
        last_row = [0] * len(batch)
        for i in order:
            item = batch[i]
            seq, begin = item.seq, item.seq.num_computed_tokens
            end = begin + item.num_tokens
            table = seq.block_table
            if i in is_decode:
                step.decode_tables.append(table)
                step.decode_lens.append(end)
                step.input_ids.append(seq.token_ids[begin])
                step.positions.append(begin)
                step.slot_mapping.append(table[begin // page_size] * page_size + begin % page_size)
            else:
                step.prefills.append(PrefillRows(len(step.input_ids), item.num_tokens, end, table))
                step.input_ids.extend(seq.token_ids[begin:end])
                step.positions.extend(range(begin, end))
                step.slot_mapping.extend(
                    table[p // page_size] * page_size + p % page_size for p in range(begin, end)
                )
            last_row[i] = len(step.input_ids) - 1
        step.sample_rows = [last_row[i] for i, needed in enumerate(needs_logits) if needed]
        return step

    def _run_paged_decode(
        self, batch: list[ScheduledSeq], needs_logits: list[bool], feed: Feed | None
    ) -> RunResult:
        page_size = self.page_size
        inputs = DecodeInputs([], [], [], [], [])
        for item in batch:
            seq, pos = item.seq, item.seq.num_computed_tokens
            if feed is None:
                inputs.input_ids.append(seq.token_ids[pos])
            inputs.positions.append(pos)
            inputs.slot_mapping.append(seq.block_table[pos // page_size] * page_size + pos % page_size)
            inputs.context_lens.append(pos + 1)
            inputs.block_tables.append(seq.block_table)
        width = max(len(table) for table in inputs.block_tables)
        graphs = self.graphs
        argmax: torch.Tensor | None = None
        read_back: ReadBack | None = None
        if graphs is not None and len(batch) <= graphs.max_batch and width <= graphs.max_pages_per_seq:
            logits, argmax, read_back = graphs.run(inputs, feed)
        else:
            device = self.device
            tables = [table + [0] * (width - len(table)) for table in inputs.block_tables]
            ctx = AttnContext(
                slot_mapping=torch.tensor(inputs.slot_mapping, dtype=torch.int64, device=device), seqs=[],
                paged_decode=PagedDecode(
                    torch.tensor(tables, dtype=torch.int32, device=device),
                    torch.tensor(inputs.context_lens, dtype=torch.int32, device=device), page_size,
                ),
            )
            ids_t = (
                torch.tensor(inputs.input_ids, dtype=torch.int64, device=device) if feed is None
                else _fed_ids(feed, device)
            )
            pos_t = torch.tensor(inputs.positions, dtype=torch.int64, device=device)
            logits = self.model.logits(self.model(ids_t, pos_t, self.kv_cache.kv, ctx))
            argmax = logits.argmax(dim=-1)
        sampled_index = [i for i, needed in enumerate(needs_logits) if needed]
        if len(sampled_index) != len(batch):
            logits = logits[sampled_index]
            argmax = read_back = None
        return RunResult(logits, sampled_index, argmax, read_back)

    def _slots(self, block_table: list[int], num_positions: int) -> torch.Tensor:
        # position p -> table[p // page_size] * page_size + p % page_size; [num_positions]
        table = torch.tensor(block_table, dtype=torch.int64, device=self.device)
        pos = torch.arange(num_positions, dtype=torch.int64, device=self.device)
        return table[pos // self.page_size] * self.page_size + pos % self.page_size


def _fed_ids(feed: Feed, device: torch.device) -> torch.Tensor:
    rows = torch.tensor(feed.rows, dtype=torch.int64).to(device, non_blocking=True)
    fed = feed.source.index_select(0, rows)
    if not feed.host_ids:
        return fed
    return torch.cat([fed, torch.tensor(feed.host_ids, dtype=torch.int64).to(device, non_blocking=True)])


def _is_fed_decode(batch: list[ScheduledSeq]) -> bool:
    # One new position per sequence, its token not necessarily on the host yet.
    return bool(batch) and all(item.num_tokens == 1 for item in batch)


def _is_pure_decode(batch: list[ScheduledSeq]) -> bool:
    return bool(batch) and all(
        item.num_tokens == 1 and item.seq.num_computed_tokens > 0 for item in batch
    )
