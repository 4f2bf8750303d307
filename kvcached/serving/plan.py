"""One packed step of the serving loop as a single int64 tensor, and the model call over it.

The scheduler turns its batch into a StepPlan; every rank that holds a part of the model runs
``plan.forward(model, cache)``. One flat tensor (plus five sizes) is what a tensor-parallel
leader broadcasts to its workers: two messages per step instead of one per field, and one
host-to-device copy instead of six (kvcached.serving.tp).
"""

from __future__ import annotations

import torch

from .attention import StepMetadata, running_step

NUM_SIZES = 5                   # num_tokens, num_seqs, table_width, num_logits, num_decodes


class StepPlan:
    """The inputs of one step: token ids, positions and KV slots per token, block tables, cached
    lengths and query starts per request, and the positions whose logits are wanted;
    ``num_decodes``: the first requests that run one token each (decode rows, which the
    attention reads through the decode kernel).

    ``data`` is laid out as [input_ids T | positions T | slot_mapping T | seq_lens B |
    query_start_loc B+1 | logits_index K | block_tables B*W]; the properties are views of it.
    """

    def __init__(self, sizes: tuple[int, int, int, int, int], data: torch.Tensor):
        self.num_tokens, self.num_seqs, self.table_width, self.num_logits, self.num_decodes = sizes
        if data.numel() != self.data_len(sizes):
            raise ValueError(f"a step of sizes {sizes} needs {self.data_len(sizes)} int64 values, got {data.numel()}")
        self.data = data

    @staticmethod
    def data_len(sizes: tuple[int, ...]) -> int:
        tokens, seqs, width, logits = sizes[:4]
        return 3 * tokens + 2 * seqs + 1 + logits + seqs * width

    @staticmethod
    def offsets(sizes: tuple[int, ...]) -> tuple[int, ...]:
        """Where each field starts in ``data`` (input_ids, positions, slot_mapping, seq_lens,
        query_start_loc, logits_index, block_tables), then its length."""
        tokens, seqs, width, logits = sizes[:4]
        seq_lens = 3 * tokens
        logits_index = seq_lens + 2 * seqs + 1
        tables = logits_index + logits
        return 0, tokens, 2 * tokens, seq_lens, seq_lens + seqs, logits_index, tables, tables + seqs * width

    @classmethod
    def build(cls, input_ids: list[int], positions: list[int], slot_mapping: list[int], seq_lens: list[int],
              query_start_loc: list[int], logits_index: list[int], block_tables: list[list[int]],
              device) -> StepPlan:
        """Pack the lists (block_tables rows of equal width) and copy them to `device` at once."""
        width = len(block_tables[0]) if block_tables else 0
        flat = input_ids + positions + slot_mapping + seq_lens + query_start_loc + logits_index
        for row in block_tables:
            flat += row
        q_lens = [b - a for a, b in zip(query_start_loc, query_start_loc[1:])]
        decodes = next((r for r, n in enumerate(q_lens) if n != 1), len(q_lens))
        sizes = (len(input_ids), len(seq_lens), width, len(logits_index), decodes)
        return cls(sizes, torch.tensor(flat, dtype=torch.int64).to(device))

    @property
    def sizes(self) -> tuple[int, int, int, int, int]:
        return self.num_tokens, self.num_seqs, self.table_width, self.num_logits, self.num_decodes

    def _part(self, start: int, length: int) -> torch.Tensor:
        return self.data[start:start + length]

    @property
    def input_ids(self) -> torch.Tensor:
        return self._part(0, self.num_tokens)

    @property
    def positions(self) -> torch.Tensor:
        return self._part(self.num_tokens, self.num_tokens)

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self._part(2 * self.num_tokens, self.num_tokens)

    @property
    def seq_lens(self) -> torch.Tensor:
        return self._part(3 * self.num_tokens, self.num_seqs)

    @property
    def query_start_loc(self) -> torch.Tensor:
        return self._part(3 * self.num_tokens + self.num_seqs, self.num_seqs + 1)

    @property
    def logits_index(self) -> torch.Tensor:
        return self._part(3 * self.num_tokens + 2 * self.num_seqs + 1, self.num_logits)

    @property
    def block_tables(self) -> torch.Tensor:
        start = 3 * self.num_tokens + 2 * self.num_seqs + 1 + self.num_logits
        return self._part(start, self.num_seqs * self.table_width).view(self.num_seqs, self.table_width)

    def forward(self, model, cache, *, logits: bool = True) -> torch.Tensor:
        """Run `model` once over the step, writing K/V into `cache`; returns the logits
        ``[num_logits, vocab]`` at logits_index (``[0, vocab]`` when logits is False: a rank that
        does not sample skips the LM head)."""
        step = StepMetadata(cache=cache, slot_mapping=self.slot_mapping, block_tables=self.block_tables,
                            seq_lens=self.seq_lens, query_start_loc=self.query_start_loc,
                            num_decodes=self.num_decodes)
        keep = self.logits_index if logits else self.logits_index[:0]
        with torch.inference_mode(), running_step(step):
            out = model(input_ids=self.input_ids.unsqueeze(0), position_ids=self.positions.unsqueeze(0),
                        use_cache=False, logits_to_keep=keep)
        return out.logits[0]
