"""DecodeInputs: a decode forward's inputs in one preallocated buffer, moved with one copy a step.

Token ids, positions, slots and context lengths (`rows` int32 each), then the block tables row by
row, in one flat device buffer filled from a pinned host twin. A batch of b rows needs a prefix of
it, so one copy moves a step's inputs, and a CUDA graph captured on the buffer replays any batch
padded up to its bucket: padding rows write no K or V (slot -1) and attend over one token of block 0.
"""
import numpy as np
import torch

from common.errors import LabError

from .model import AttentionMetadata
from .sequence import Sequence


class DecodeInputs:
    def __init__(self, rows: int, blocks_per_seq: int, device: torch.device):
        self.rows, self.blocks_per_seq = rows, blocks_per_seq
        self.is_cuda = device.type == "cuda"
        n = rows
        self._host = torch.zeros(4 * n + n * blocks_per_seq, dtype=torch.int32, pin_memory=self.is_cuda)
        self._host_np = self._host.numpy()
        # the device buffer the forwards (and the graphs) read; on a CPU the host buffer itself
        self.tensor = torch.zeros_like(self._host, device=device) if self.is_cuda else self._host
        self._host_np[2 * n:3 * n] = -1            # padding rows write no K/V ...
        self._host_np[3 * n:4 * n] = 1             # ... and attend over one token of block 0
        self.tensor.copy_(self._host)
        self._columns = [self._host_np[i * n:(i + 1) * n] for i in range(4)]
        self._words = memoryview(self._host_np)
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._tables = self._host_np[4 * n:].reshape(n, blocks_per_seq)
        self._sent = torch.cuda.Event() if self.is_cuda else None     # the last send's copy has left the host twin
        self.forget_written_tables()

    def forget_written_tables(self) -> None:
        """Per row, the block table list last written there and how many of its entries: a decode
        step writes only the blocks a row's sequence gained (lists only grow; a new allocation is a
        new list, kept alive here so its identity cannot be reused). Forgotten: every row rewritten."""
        self._written_tables: list[tuple[list[int] | None, int]] = [(None, 0)] * self.rows

    def write(self, seqs: list[Sequence], positions: list[int] | None, block_size: int, pending: bool = False) -> int:
        """Row r feeds seqs[r]'s last token (or its token at positions[r]); returns the longest
        context. pending: row r feeds instead the token seqs[r] has sampled but not appended yet,
        at position num_tokens (its id written 0 here: `gather_ids` puts it in on the device).
        Waits for the previous send's copy to leave the host twin before rewriting it."""
        n, m, bs = len(seqs), self.rows, block_size
        if n > m:
            raise LabError(f"{n} decode rows exceed the runner's {m}")
        if self._sent is not None:
            self._sent.synchronize()
        words = self._words                               # the columns, written one int at a time
        tables, written_tables = self._tables, self._written_tables
        max_context = 0
        for row, s in enumerate(seqs):
            token_ids, table = s.token_ids, s.block_table
            if pending:
                p = len(token_ids)
                words[row] = 0
            else:
                p = len(token_ids) - 1 if positions is None else positions[row]
                words[row] = token_ids[p]
            words[m + row] = p
            words[2 * m + row] = table[p // bs] * bs + p % bs
            words[3 * m + row] = p + 1
            max_context = max(max_context, p + 1)
            written, count = written_tables[row]
            if written is not table:
                tables[row, :len(table)] = table
                written_tables[row] = (table, len(table))
            elif count != len(table):
                tables[row, count:len(table)] = table[count:]
                written_tables[row] = (table, len(table))
        return max_context

    def send(self, n: int, padded: int) -> None:
        """Pad rows n .. padded (a graph's bucket) and copy the prefix they use to the device."""
        if not self.is_cuda:
            return
        if padded > n:
            _, positions, slots, context_lens = self._columns
            positions[n:padded] = 0                        # padding rows: position 0, no K/V write
            slots[n:padded] = -1
            context_lens[n:padded] = 1
        views = self._views.get(padded)
        if views is None:                                  # the prefix a batch of `padded` rows uses
            used = 4 * self.rows + padded * self.blocks_per_seq
            views = self._views[padded] = (self.tensor[:used], self._host[:used])
        views[0].copy_(views[1], non_blocking=True)
        if self._sent is not None:
            self._sent.record(torch.cuda.current_stream(self.tensor.device))

    def gather_ids(self, n: int, tokens: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Rows 0 .. n of the device token ids from `tokens` (a previous step's, on the device) at
        `rows` (None: its first n, in order): queued after the send, so the step reads them
        without the host having seen them."""
        self.tensor[:n].copy_(tokens[:n] if rows is None else tokens.index_select(0, rows))

    def write_probe_row(self, context_tokens: int, block_size: int) -> None:
        """Row 0 alone: a token at position context_tokens - 1 attending over blocks 0, 1, ... of
        the pool, writing no K or V; the next real step rewrites row 0's table."""
        m, blocks = self.rows, -(-context_tokens // block_size)
        host = self._host_np
        host[0], host[m], host[2 * m], host[3 * m] = 1, context_tokens - 1, -1, context_tokens
        self._tables[0, :blocks] = np.arange(blocks, dtype=np.int32)
        self._written_tables[0] = (None, 0)
        if self.is_cuda:
            self.tensor.copy_(self._host)

    def forward_args(self, n: int, num_splits: int | None) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(token ids, positions, attention metadata) of the first n rows of the device buffer."""
        m, inputs = self.rows, self.tensor
        meta = AttentionMetadata(is_prefill=False, slot_mapping=inputs[2 * m:2 * m + n],
                                 block_tables=inputs[4 * m:].view(m, self.blocks_per_seq)[:n],
                                 context_lens=inputs[3 * m:3 * m + n], num_splits=num_splits)
        return inputs[:n], inputs[m:m + n], meta
