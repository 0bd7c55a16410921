"""A full layer of the KIVI quantized cache: positions ``0..Q-1`` as integer codes, the newest in full precision.

See :class:`kvexplore.caches.quantized.QuantizedCache` for the layout, the frontier ``Q`` and what a rewind does;
the quantization itself is :mod:`kvexplore.caches.kivi`.
"""

from __future__ import annotations

from typing import Any

import torch

from ...core import host
from ..layer import FullLayer, Step
from ..layout import QuantizedLayout
from ..memory import StepCounters
from ..kivi import F32, dequantize_keys, dequantize_values, quantize_keys, quantize_values
from ..slots import FILLED, FREE, STALE, SlotView

TENSORS = ("kq", "vq", "ks", "kz", "vs", "vz", "rk", "rv", "kerr", "verr")  # kerr, verr: diagnostics, not storage


class QuantizedLayer(FullLayer):
    """One layer's codes (``kq``/``vq``), scales and zeros (``ks``/``kz`` per key block, ``vs``/``vz`` per value
    token), full-precision residual (``rk``/``rv``), per-position max errors (``kerr``/``verr``) and frontier
    ``qf``."""

    held_names = {"kq": "keys and values", "vq": "keys and values", "ks": "scales and zero points",
                  "kz": "scales and zero points", "vs": "scales and zero points", "vz": "scales and zero points",
                  "kerr": "stored error (for the views)", "verr": "stored error (for the views)"}

    @classmethod
    def refuses(cls, spec) -> str | None:
        if spec.latent:
            return ("the quantized cache stores keys and values of one width; an MLA model's latent cache "
                    "(DeepSeek) stores a latent and a rope key instead: use preallocated, concat, paged or none")
        return None

    def __init__(self, spec, batch_size: int, dtype: torch.dtype, device: torch.device, max_seq_len: int,
                 bits: int | tuple[int, int], group_size: int, residual: int) -> None:
        super().__init__(spec, batch_size, dtype, device)
        self.kbits, self.vbits = (bits, bits) if isinstance(bits, int) else bits  # keys', values' code widths
        self.group_size, self.residual, self.capacity = group_size, residual, max_seq_len
        self.nq = max_seq_len // group_size * group_size  # quantizable slots: whole blocks only
        self.nr = min(max_seq_len, residual + group_size - 1)  # residual slots
        B, G, H, D, nq, nr = batch_size, group_size, spec.kv_heads, spec.head_dim, self.nq, self.nr

        def zeros(*shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.kq = zeros(B, H, nq, D * self.kbits // 8, dtype=torch.uint8)
        self.vq = zeros(B, H, nq, D * self.vbits // 8, dtype=torch.uint8)
        self.ks, self.kz = zeros(B, H, nq // G, D), zeros(B, H, nq // G, D)
        self.vs, self.vz = zeros(B, H, nq, D // self.value_group), zeros(B, H, nq, D // self.value_group)
        self.rk, self.rv = zeros(B, H, nr, D, dtype=dtype), zeros(B, H, nr, D, dtype=dtype)
        self.kerr, self.verr = zeros(B, H, max_seq_len), zeros(B, H, max_seq_len)  # max abs error per position
        self.qf = 0  # the quantized frontier
        self.qf_start = 0  # the frontier before the step under way (what a cut of its drafts compares with)
        self.columns = None  # (mask, positions) of a chunk that read each position as one-token steps would
        self.q_high = self.r_high = 0  # slots below these were written at some point

    @property
    def value_group(self) -> int:
        """Channels per value scale: ``min(group_size, head_dim)``."""
        return min(self.group_size, self.spec.head_dim)

    crop_way = ("the residual is cut; a draft that pushed blocks into the quantized part is rolled back (the "
                "flush undone) and the accepted tokens are written again")

    def begin(self, step: Step) -> None:
        step.journal.remember(self._restore, (self.qf, self.q_high, self.r_high))
        self.qf_start, self.columns = self.qf, None

    def mask(self, step: Step) -> torch.Tensor | None:
        return super().mask(step) if self.columns is None else self.columns[0]

    def read_positions(self, length: int) -> list[int]:
        return super().read_positions(length) if self.columns is None else list(self.columns[1])

    def _as_steps(self, pos: int, end: int, qf: int, fk: torch.Tensor, fv: torch.Tensor):
        """What a chunk of queries ``pos..end-1`` appended after position 0 reads when it pushes blocks out of the
        window: each query what it would have read decoded one token at a time (the frontier of its own step), so a
        speculative verification gives plain decoding's logits. The keys are the dequantized ``0..Q-1`` (the new
        frontier) then the full-precision ``qf..end-1`` (``fk``/``fv``), and the mask picks one of the two copies
        of each position per query."""
        G, device = self.group_size, fk.device
        kd, vd = self.read_upto(self.qf)
        keys, values = torch.cat([kd, fk], 2), torch.cat([vd, fv], 2)
        p = torch.arange(pos, end, device=device)[:, None]
        front = ((p + 1 - self.residual).div(G, rounding_mode="floor") * G).clamp(min=qf, max=self.nq)
        deq, full = torch.arange(self.qf, device=device)[None, :], torch.arange(qf, end, device=device)[None, :]
        mask = torch.cat([deq < front, (full >= front) & (full <= p)], 1)
        self.columns = (mask, [*range(self.qf), *range(qf, end)])
        return keys, values

    def crop_error(self, n: int, length: int) -> str | None:
        G = self.group_size
        would = min(self.nq, max(self.qf_start, (n - self.residual) // G * G))
        if n < length and self.qf > would:
            return (f"the draft pushed positions {would}..{self.qf - 1} into the quantized part (a step that stopped "
                    f"at {n} keeps them in the full-precision residual)")
        return None

    def _restore(self, saved: tuple[int, int, int]) -> None:
        self.qf, self.q_high, self.r_high = saved

    def write(self, step: Step, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        G, c, journal, pos = self.group_size, step.counters, step.journal, step.pos
        end = pos + k.shape[2]
        rewrites = pos < step.length  # a write before the end rewrites held codes and residual
        if rewrites:  # keep the whole layer
            for name in TENSORS:
                t = getattr(self, name)
                journal.keep(t, 2, 0, t.shape[2])
        if pos < self.qf:
            c.copied_bytes += self.unquantize_tail(pos)
        qf = self.qf
        new_qf = min(self.nq, max(qf, (end - self.residual) // G * G))
        if not rewrites:
            self._keep_touched(journal, pos, end, qf, new_qf)
        rk, rv = self.rk, self.rv
        self.kerr[:, :, pos:end] = 0
        self.verr[:, :, pos:end] = 0
        as_steps = None  # a chunk after position 0 that flushes: what its queries read, one-token steps' way
        if new_qf == qf:  # everything new goes to the residual, in place
            rk[:, :, pos - qf:end - qf] = k
            rv[:, :, pos - qf:end - qf] = v
            c.written_bytes += k.nbytes + v.nbytes
        else:  # blocks leave the window: quantize them, keep the rest of old residual + new as the residual
            fk = torch.cat([rk[:, :, :pos - qf], k.to(self._dtype)], 2)  # positions qf..end-1
            fv = torch.cat([rv[:, :, :pos - qf], v.to(self._dtype)], 2)
            n = new_qf - qf
            self.quantize(c, qf, fk[:, :, :n], fv[:, :, :n])
            keep, moved = end - new_qf, max(0, pos - new_qf)  # moved: old residual positions shifted down
            rk[:, :, :keep] = fk[:, :, n:]
            rv[:, :, :keep] = fv[:, :, n:]
            per_token = 2 * k.shape[0] * k.shape[1] * k.shape[3] * rk.element_size()
            c.copied_bytes += moved * per_token
            c.written_bytes += (keep - moved) * per_token
            self.qf = new_qf
            if 0 < pos and end - pos > 1:
                as_steps = self._as_steps(pos, end, qf, fk, fv)
        self.q_high = max(self.q_high, new_qf)
        self.r_high = max(self.r_high, end - new_qf)
        return self.read_upto(end) if as_steps is None else as_steps

    def _keep_touched(self, journal, pos: int, end: int, qf: int, new_qf: int) -> None:
        """Keep every slot a write of ``pos..end-1`` at the end of the sequence touches, so a rollback restores
        the storage bit for bit: the error records and the residual slots written, or, when blocks leave the
        window (``new_qf > qf``), the whole residual (it shifts down) and the codes and scales of those blocks."""
        G = self.group_size
        for t in (self.kerr, self.verr):
            journal.keep(t, 2, pos, end - pos)
        if new_qf == qf:
            for t in (self.rk, self.rv):
                journal.keep(t, 2, pos - qf, end - pos)
            return
        for t in (self.rk, self.rv):
            journal.keep(t, 2, 0, t.shape[2])
        for t in (self.kq, self.vq, self.vs, self.vz, self.kerr, self.verr):
            journal.keep(t, 2, qf, new_qf - qf)
        for t in (self.ks, self.kz):
            journal.keep(t, 2, qf // G, (new_qf - qf) // G)

    def read_upto(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values ``(B, H, end, D)`` in the dtype: dequantized ``0..Q-1``, then the residual (views)."""
        qf = self.qf
        rk, rv = self.rk.narrow(2, 0, end - qf), self.rv.narrow(2, 0, end - qf)
        if qf == 0:
            return rk, rv
        G, kb, vb = self.group_size, self.kbits, self.vbits
        kd = dequantize_keys(self.kq[:, :, :qf], self.ks[:, :, :qf // G], self.kz[:, :, :qf // G], kb)
        vd = dequantize_values(self.vq[:, :, :qf], self.vs[:, :, :qf], self.vz[:, :, :qf], vb)
        return torch.cat([kd.to(self._dtype), rk], 2), torch.cat([vd.to(self._dtype), rv], 2)

    def quantize(self, counters: StepCounters, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize whole blocks ``k``/``v`` ``(B, H, n * G, D)`` holding positions ``start..``; record errors."""
        G, kb, vb, end = self.group_size, self.kbits, self.vbits, start + k.shape[2]
        kc, ks, kz = quantize_keys(k, kb, G)
        vc, vs, vz = quantize_values(v, vb, self.value_group)
        self.kq[:, :, start:end], self.vq[:, :, start:end] = kc, vc
        self.ks[:, :, start // G:end // G], self.kz[:, :, start // G:end // G] = ks, kz
        self.vs[:, :, start:end], self.vz[:, :, start:end] = vs, vz
        self.kerr[:, :, start:end] += (dequantize_keys(kc, ks, kz, kb) - k.to(F32)).abs().amax(-1)
        self.verr[:, :, start:end] += (dequantize_values(vc, vs, vz, vb) - v.to(F32)).abs().amax(-1)
        counters.written_bytes += sum(t.nbytes for t in (kc, ks, kz, vc, vs, vz))

    def unquantize_tail(self, n: int) -> int:
        """Drop positions ``>= n`` when the frontier is past ``n``: the straddling block's positions below ``n``
        move, dequantized, into the residual. Returns the bytes written there."""
        G = self.group_size
        start = n // G * G
        if n > start:
            block = slice(start // G, start // G + 1)
            kd = dequantize_keys(self.kq[:, :, start:start + G], self.ks[:, :, block], self.kz[:, :, block],
                                 self.kbits)[:, :, :n - start]
            vd = dequantize_values(self.vq[:, :, start:n], self.vs[:, :, start:n], self.vz[:, :, start:n],
                                   self.vbits)
            self.rk[:, :, :n - start] = kd
            self.rv[:, :, :n - start] = vd
        self.qf = start
        return 2 * self.rk[:, :, :n - start].nbytes

    def truncate(self, n: int, length: int, counters: StepCounters) -> None:
        if self.qf > n:
            self.unquantize_tail(n)

    def advance(self, target: int, n: int, counters: StepCounters) -> None:
        """Bring the frontier up to ``target`` (<= ``n``, the length) by quantizing kept residual positions, as
        the retry of an interrupted pass would (every layer then holds the same layout again)."""
        qf = self.qf
        if qf >= target:
            return
        rk, rv = self.rk, self.rv  # positions qf..target-1 < n are valid in the residual
        self.quantize(counters, qf, rk[:, :, :target - qf], rv[:, :, :target - qf])
        rk[:, :, :n - target] = rk[:, :, target - qf:n - qf].clone()
        rv[:, :, :n - target] = rv[:, :, target - qf:n - qf].clone()
        self.qf = target

    def error(self, length: int, part: str) -> torch.Tensor:
        k, v = self.kerr[:, :, :length], self.verr[:, :, :length]
        return {"k": k, "v": v, "kv": torch.maximum(k, v)}[part].clone()

    def stored_error(self, length: int) -> torch.Tensor | None:
        return host.fetch([self.error(length, "kv")[0].float()])[0]

    def storage(self) -> list[torch.Tensor]:
        return [self.rk, self.rv]  # a read is a view of these only while nothing is quantized

    def bytes_by_part(self) -> dict[str, int]:
        """Bytes of storage held, by part: integer codes, scales + zeros, full-precision residual."""
        size = lambda *ts: sum(t.nbytes for t in ts)  # noqa: E731
        return {"integers": size(self.kq, self.vq), "scales": size(self.ks, self.kz, self.vs, self.vz),
                "residual": size(self.rk, self.rv)}

    def reserved_bytes(self) -> int:
        return sum(self.bytes_by_part().values())

    def used_bytes(self, length: int) -> int:
        """Codes and scales of ``0..Q-1``, residual of ``Q..length-1``."""
        q, G, spec = self.qf, self.group_size, self.spec
        bhd = self._batch * spec.kv_heads * spec.head_dim
        codes = bhd * q * (self.kbits + self.vbits) // 8
        scales = 2 * 4 * bhd * (q // G + q // self.value_group)
        residual = 2 * bhd * (length - q) * self._dtype.itemsize
        return codes + scales + residual

    def slot_view(self, length: int) -> SlotView:
        """The ``Nq`` quantized slots, then the ``Nr`` full-precision residual slots."""
        q, n, nq, nr = self.qf, length, self.nq, self.nr
        r = n - q
        qh, rh = max(q, self.q_high), max(r, self.r_high)
        states = ([FILLED] * q + [STALE] * (qh - q) + [FREE] * (nq - qh)
                  + [FILLED] * r + [STALE] * (rh - r) + [FREE] * (nr - rh))
        positions = list(range(q)) + [-1] * (nq - q) + list(range(q, n)) + [-1] * (nr - r)
        sharers = [1] * q + [0] * (nq - q) + [1] * r + [0] * (nr - r)
        layout = QuantizedLayout(bits=self.kbits, value_bits=None if self.vbits == self.kbits else self.vbits,
                                 group_size=self.group_size, residual_window=self.residual,
                                 quantized_upto=q, quantized_slots=nq, residual=list(range(nq, nq + r)))
        return SlotView(states, positions, sharers, layout)

    def clone(self, memo: dict[int, Any]) -> "QuantizedLayer":
        twin = object.__new__(QuantizedLayer)
        twin.__dict__.update(self.__dict__)
        for name in TENSORS:
            setattr(twin, name, getattr(self, name).clone())
        return twin
