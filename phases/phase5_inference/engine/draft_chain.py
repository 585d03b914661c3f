"""DraftChain: a speculative draft's k forwards chained on the device, the host waiting once.

The first forward is the runner's rows_logits (a sequence may fill several rows: the draft catching
up on tokens it has not cached); each later forward feeds every sequence its previous token at the
next position, copied on the device, its other inputs (positions, slots, context lengths) written
into pinned host buffers up front. Tokens are argmaxes, or draws from softmax(logits / T) by the
exponential race.
"""
import torch

from .cuda_graphs import decode_splits
from .sampler import categorical
from .sequence import Sequence


class DraftChain:
    """The chained steps of one (draft) runner, and their pinned host and device buffers, made on
    first use and grown to the longest chain asked for."""

    def __init__(self, runner):
        self.runner = runner
        self._columns = None

    @torch.inference_mode()
    def tokens(self, seqs: list[Sequence], positions: list[int], last_rows: list[int], steps: int,
               temperatures: list[float] | None = None, probs_out: torch.Tensor | None = None,
               generator: torch.Generator | None = None, lengths: list[int] | None = None) -> list[list[int]]:
        """Tokens of `steps` chained forwards. The first is rows_logits(seqs, positions); row
        last_rows[i] gives sequence i (seqs[last_rows[i]]) its first token. With `temperatures`
        (one per sequence, > 0) each distribution is written to probs_out[i, step]. Every position
        a later step writes must have its block already. lengths[i]: steps sequence i needs (all
        when None); past them its row repeats its last position and writes no K or V (its tokens
        there are meaningless). [sequence][step] token ids."""
        runner = self.runner
        m, width, bs = runner.max_num_seqs, runner.max_blocks_per_seq, runner.block_size
        n = len(last_rows)
        owners = [seqs[r] for r in last_rows]
        first = [positions[r] for r in last_rows]
        self._stage(steps)
        columns, tables, index = self._columns.numpy(), self._tables.numpy().reshape(m, width), self._index_host.numpy()
        for j in range(1, steps):                              # every later step's inputs, written up front
            tokens, at, slots, context = columns[j].reshape(4, m)
            tokens[:] = 0
            at[:] = 0
            slots[:] = -1
            context[:] = 1
            for i, seq in enumerate(owners):
                if lengths is not None and j >= lengths[i]:
                    at[i] = first[i] + lengths[i] - 1
                    context[i] = at[i] + 1                     # slot stays -1: nothing written
                    continue
                p = first[i] + j
                at[i] = p
                slots[i] = seq.block_table[p // bs] * bs + p % bs
                context[i] = p + 1
        for i, seq in enumerate(owners):
            tables[i, :len(seq.block_table)] = seq.block_table
        index[:n] = last_rows
        scale = None
        if temperatures is not None:
            self._scale_host.numpy()[:n] = [1.0 / t for t in temperatures]
            scale = self._scale[:n]
            scale.copy_(self._scale_host[:n], non_blocking=True)
        out = self._tokens
        logits, argmax = runner.rows_logits(seqs, positions)
        if last_rows != list(range(len(seqs))):
            self._index[:n].copy_(self._index_host[:n], non_blocking=True)
            logits = logits.index_select(0, self._index[:n])
            argmax = None if argmax is None else argmax.index_select(0, self._index[:n])
        out[0, :n].copy_(self._pick(logits, argmax, scale, probs_out, 0, generator))
        inputs = runner.decode_inputs.tensor
        for j in range(1, steps):
            inputs[:4 * m].copy_(self._columns[j], non_blocking=True)
            if j == 1:
                inputs[4 * m:4 * m + n * width].copy_(self._tables[:n * width], non_blocking=True)
            inputs[:n].copy_(out[j - 1, :n])
            max_context = max(first) + j + 1
            if runner.graphs:
                logits, argmax = runner.graphs.decode(n, max_context)
            else:
                splits = decode_splits(n, runner.shape.num_key_value_heads, max_context, runner.sms)
                logits, argmax = runner.decode_forward(n, splits), None
            out[j, :n].copy_(self._pick(logits, argmax, scale, probs_out, j, generator))
        if not runner.is_cuda:                                 # on a CPU the inputs are the host buffer itself
            runner.decode_inputs.forget_written_tables()
        flat = self._readback(out[:steps, :n].reshape(-1))    # step by step
        return [flat[i::n] for i in range(n)]

    @staticmethod
    def _pick(logits, argmax, inverse_temperature, probs_out, step, generator) -> torch.Tensor:
        if inverse_temperature is None:
            return logits.argmax(dim=1) if argmax is None else argmax
        probs = (logits * inverse_temperature[:, None]).softmax(dim=1)
        probs_out[:, step] = probs
        return categorical(probs, generator)

    def _stage(self, steps: int) -> None:
        """Pinned host buffers (each later step's four columns, the block tables, the first step's
        gather index, the inverse temperatures), their device twins, the chained tokens."""
        runner = self.runner
        m, width, pin, device = runner.max_num_seqs, runner.max_blocks_per_seq, runner.is_cuda, runner.device
        if self._columns is None or self._columns.shape[0] < steps:
            size = max(steps, 8)
            self._columns = torch.zeros(size, 4 * m, dtype=torch.int32, pin_memory=pin)
            self._tables = torch.zeros(m * width, dtype=torch.int32, pin_memory=pin)
            self._index_host = torch.zeros(m, dtype=torch.int64, pin_memory=pin)
            self._index = torch.zeros(m, dtype=torch.int64, device=device)
            self._tokens = torch.zeros(size, m, dtype=torch.int64, device=device)
            self._scale_host = torch.zeros(m, dtype=torch.float32, pin_memory=pin)
            self._scale = torch.zeros(m, dtype=torch.float32, device=device)
            self._readback = runner.token_readback(size * m)
