"""A full layer of the KIVI quantized cache: positions ``0..Q-1`` as integer codes, the newest in full precision (the
layout, the frontier ``Q`` and what a rewind does: docs/strategies.md; the codes: :mod:`kvexplore.caches.kivi`)."""

from __future__ import annotations

from typing import Any

import torch

from ...core import host
from ..layer import FullLayer, Step, shallow_copy
from ..layout import QuantizedLayout
from ..memory import StepCounters
from ..channel_detail import PartDetail, block_rows
from ..kivi import F32, unpack
from ..kv_codec import Codec
from ..slots import FILLED, FREE, STALE, SlotView

# each part's stored tensors: codes, scale, zero, outliers' channels and values (when kept), by stored name
STORED = ("codes", "scale", "zero", "out_idx", "out_val")
NAMES = {"k": ("kq", "ks", "kz", "koi", "kov"), "v": ("vq", "vs", "vz", "voi", "vov")}


class QuantizedLayer(FullLayer):
    """One layer's codes (``kq``/``vq``), scales and zeros (``ks``/``kz``, ``vs``/``vz``: per block of tokens on the
    channel axis, per token on the token axis), outliers kept exact (channels ``koi``/``voi``, values
    ``kov``/``vov``), full-precision residual (``rk``/``rv``), per-position max errors (``kerr``/``verr``) and frontier
    ``qf``. How each part is encoded is its :class:`~kvexplore.caches.kv_codec.Codec` (``kcodec``, ``vcodec``)."""

    _held_names = {"kq": "keys and values", "vq": "keys and values", "ks": "scales and zero points",
                  "kz": "scales and zero points", "vs": "scales and zero points", "vz": "scales and zero points",
                  "koi": "outliers (kept exact)", "kov": "outliers (kept exact)", "voi": "outliers (kept exact)",
                  "vov": "outliers (kept exact)", "kcodec": "rotation", "vcodec": "rotation",
                  "kerr": "stored error (for the views)", "verr": "stored error (for the views)",
                  "kcherr": "stored error (for the views)", "vcherr": "stored error (for the views)"}

    @classmethod
    def refuses(cls, spec) -> str | None:
        if spec.latent:
            return ("the quantized cache stores keys and values of one width; an MLA model's latent cache "
                    "(DeepSeek) stores a latent and a rope key instead: use preallocated, concat, paged or none")
        return None

    def __init__(self, spec, batch_size: int, dtype: torch.dtype, device: torch.device, max_seq_len: int,
                 codecs: tuple[Codec, Codec], group_size: int, residual: int,
                 layer_type: str = "full_attention") -> None:
        super().__init__(spec, batch_size, dtype, device)
        self.kcodec, self.vcodec = codecs
        self.kbits, self.vbits = self.kcodec.bits, self.vcodec.bits  # keys', values' code widths
        self.group_size, self.residual, self.capacity = group_size, residual, max_seq_len
        self.layer_type, self.rotary = layer_type, None  # the model's rotary: attached before a step (pre-RoPE keys)
        self.exact_prefill = False  # a prompt at position 0 reads what it wrote, not the blocks it quantized
        self.nq = max_seq_len // group_size * group_size  # quantizable slots: whole blocks only
        self.nr = min(max_seq_len, residual + group_size - 1)  # residual slots
        B, H, nq, nr = batch_size, spec.kv_heads, self.nq, self.nr
        Dk, Dv = spec.head_dim, spec.value_width

        def zeros(*shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        for part, codec, D in (("k", self.kcodec, Dk), ("v", self.vcodec, Dv)):
            q, s, z, oi, ov = NAMES[part]
            setattr(self, q, zeros(B, H, nq, D * codec.bits // 8, dtype=torch.uint8))
            setattr(self, s, zeros(*codec.scale_shape(B, H, nq, D)))
            setattr(self, z, zeros(*codec.scale_shape(B, H, nq, D)))
            n = codec.outliers
            setattr(self, oi, zeros(B, H, nq, n, dtype=torch.int16) if n else None)
            setattr(self, ov, zeros(B, H, nq, n, dtype=dtype) if n else None)
        self.rk, self.rv = zeros(B, H, nr, Dk, dtype=dtype), zeros(B, H, nr, Dv, dtype=dtype)
        self.kerr, self.verr = zeros(B, H, max_seq_len), zeros(B, H, max_seq_len)  # max abs error per position
        # max abs error per block of group_size positions and channel (the views' error per channel)
        self.kcherr, self.vcherr = zeros(B, H, nq // group_size, Dk), zeros(B, H, nq // group_size, Dv)
        self.qf = 0  # the quantized frontier
        self.qf_start = 0  # the frontier before the step under way (what a cut of its drafts compares with)
        self.columns = None  # (mask, positions) of a chunk that read each position as one-token steps would
        self.q_high = self.r_high = 0  # slots below these were written at some point

    def _tensors(self) -> list[str]:
        return [n for names in NAMES.values() for n in names if getattr(self, n) is not None] + \
            ["rk", "rv", "kerr", "verr", "kcherr", "vcherr"]

    def _codec(self, part: str) -> Codec:
        return self.kcodec if part == "k" else self.vcodec

    def rope_turn(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        if self.rotary is None:
            from ...errors import SettingsError

            raise SettingsError("quantizing keys before RoPE (pre_rope_keys=True) needs the model's rotary embedding, "
                                "attached when the model runs a step with this cache (model(ids, cache, pos))")
        return self.rotary.turn(x, delta, self.layer_type)

    def _rows(self, part: str, start: int, end: int) -> list[tuple[str, torch.Tensor, slice]]:
        """``part``'s stored tensors, each with the rows (dim 2) that positions ``start..end-1`` use."""
        scales = self._codec(part).scale_rows(start, end)
        return [(key, t, scales if key in ("scale", "zero") else slice(start, end))
                for key, name in zip(STORED, NAMES[part]) if (t := getattr(self, name)) is not None]

    def _stored(self, part: str, start: int, end: int) -> dict[str, torch.Tensor]:
        return {key: t[:, :, rows] for key, t, rows in self._rows(part, start, end)}

    def decode(self, part: str, start: int, end: int) -> torch.Tensor:
        """Float32 ``part`` (``"k"``, ``"v"``) of positions ``start..end-1``, read back from the codes."""
        positions = torch.arange(start, end, device=self.rk.device)
        return self._codec(part).decode(self._stored(part, start, end), positions, self.rope_turn)

    _crop_way = ("the residual is cut; a draft that pushed blocks into the quantized part is rolled back (the "
                "flush undone) and the accepted tokens are written again")

    def begin(self, step: Step) -> None:
        step.journal.remember(self._restore, (self.qf, self.q_high, self.r_high))
        self.qf_start, self.columns = self.qf, None

    def mask(self, step: Step) -> torch.Tensor | None:
        return super().mask(step) if self.columns is None else self.columns[0]

    def _read_positions(self, length: int) -> list[int]:
        return super()._read_positions(length) if self.columns is None else list(self.columns[1])

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

    def _crop_error(self, n: int, length: int) -> str | None:
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
            for name in self._tensors():
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
            elif pos == 0 and self.exact_prefill:  # stored quantized, read as computed (KIVI's prefill)
                as_steps = (fk, fv)
        self.q_high = max(self.q_high, new_qf)
        self.r_high = max(self.r_high, end - new_qf)
        return self.read_upto(end) if as_steps is None else as_steps

    def _keep_touched(self, journal, pos: int, end: int, qf: int, new_qf: int) -> None:
        """Keep every slot a write of ``pos..end-1`` at the end of the sequence touches, so a rollback restores
        the storage bit for bit: the error records and the residual slots written, or, when blocks leave the
        window (``new_qf > qf``), the whole residual (it shifts down) and the codes and scales of those blocks."""
        for t in (self.kerr, self.verr):
            journal.keep(t, 2, pos, end - pos)
        if new_qf == qf:
            for t in (self.rk, self.rv):
                journal.keep(t, 2, pos - qf, end - pos)
            return
        for t in (self.rk, self.rv):
            journal.keep(t, 2, 0, t.shape[2])
        for t in (self.kerr, self.verr):
            journal.keep(t, 2, qf, new_qf - qf)
        for t in (self.kcherr, self.vcherr):
            journal.keep(t, 2, qf // self.group_size, (new_qf - qf) // self.group_size)
        for part in NAMES:
            for _, t, rows in self._rows(part, qf, new_qf):
                journal.keep(t, 2, rows.start, rows.stop - rows.start)

    def read_upto(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values ``(B, H, end, D)`` in the dtype: dequantized ``0..Q-1``, then the residual (views)."""
        qf = self.qf
        rk, rv = self.rk.narrow(2, 0, end - qf), self.rv.narrow(2, 0, end - qf)
        if qf == 0:
            return rk, rv
        kd, vd = self.decode("k", 0, qf), self.decode("v", 0, qf)
        return torch.cat([kd.to(self._dtype), rk], 2), torch.cat([vd.to(self._dtype), rv], 2)

    def quantize(self, counters: StepCounters, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize whole blocks ``k``/``v`` ``(B, H, n * G, D)`` holding positions ``start..``; record errors."""
        end = start + k.shape[2]
        positions = torch.arange(start, end, device=k.device)
        G = self.group_size
        for part, x, err, cherr in (("k", k, self.kerr, self.kcherr), ("v", v, self.verr, self.vcherr)):
            codec = self._codec(part)
            stored = self.encode(codec, x, positions)
            for key, t, rows in self._rows(part, start, end):
                t[:, :, rows] = stored[key]
            off = (codec.decode(stored, positions, self.rope_turn) - x.to(F32)).abs()
            err[:, :, start:end] += off.amax(-1)
            B, H, n, D = off.shape
            cherr[:, :, start // G:end // G] = off.view(B, H, n // G, G, D).amax(3)
            counters.written_bytes += sum(t.nbytes for t in stored.values())

    def encode(self, codec: Codec, x: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """The stored tensors of ``x`` (a method of its own: a test plants a wrong code here)."""
        return codec.encode(x, positions, self.rope_turn, self._dtype)

    def unquantize_tail(self, n: int) -> int:
        """Drop positions ``>= n`` when the frontier is past ``n``: the straddling block's positions below ``n``
        move, read back, into the residual. Returns the bytes written there."""
        G = self.group_size
        start = n // G * G
        if n > start:
            self.rk[:, :, :n - start] = self.decode("k", start, start + G)[:, :, :n - start]
            self.rv[:, :, :n - start] = self.decode("v", start, start + G)[:, :, :n - start]
        self.qf = start
        return self.rk[:, :, :n - start].nbytes + self.rv[:, :, :n - start].nbytes

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

    def channel_error(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Max abs error per KV head and channel over the quantized blocks (zeros before any)."""
        n = self.qf // self.group_size
        k, v = (t[0, :, :n].amax(1) if n else torch.zeros_like(t[0, :, 0]) for t in (self.kcherr, self.vcherr))
        return tuple(host.fetch([k, v]))

    def channel_detail(self) -> tuple[PartDetail, PartDetail] | None:
        """The keys' and the values' :class:`~kvexplore.caches.channel_detail.PartDetail` over the quantized blocks,
        for the first sequence (None before any block is quantized)."""
        G, qf = self.group_size, self.qf
        n = qf // G
        if n == 0:
            return None
        positions = torch.arange(qf, device=self.rk.device)
        out = []
        for part, cherr in (("k", self.kcherr), ("v", self.vcherr)):
            codec = self._codec(part)
            stored = self._stored(part, 0, qf)
            y = codec.decoded(stored)  # where the codes are taken
            x = codec.untransform(y, positions, self.rope_turn)
            block = cherr[0, :, :n].argmax(1)  # (H, D)
            codes = unpack(stored["codes"], codec.bits)[0]
            scale, zero = stored["scale"][0], stored["zero"][0]
            if codec.axis == "channel":  # (H, blocks, D): the block's one scale of each channel
                scale, zero = (t.gather(1, block[:, None, :]).permute(0, 2, 1) for t in (scale, zero))
            else:  # (H, positions, D // channel group): each position's scale of the channel's group
                scale, zero = (block_rows(t.repeat_interleave(codec.group, -1), block, G) for t in (scale, zero))
            sizes = [x[0].abs().amax(1)] + ([y[0].abs().amax(1)] if codec.transforms else [])
            got = host.fetch([*sizes, block, block_rows(codes, block, G), scale, zero])
            quantized = got.pop(1) if codec.transforms else None
            out.append(PartDetail("keys" if part == "k" else "values", codec.bits, codec.axis, G, got[0], quantized,
                                  *got[1:]))
        return out[0], out[1]

    def storage(self) -> list[torch.Tensor]:
        return [self.rk, self.rv]  # a read is a view of these only while nothing is quantized

    def bytes_by_part(self) -> dict[str, int]:
        """Bytes of storage held, by part: integer codes, scales + zeros, exact outliers, full-precision residual."""
        size = lambda *names: sum(getattr(self, n).nbytes for n in names if getattr(self, n) is not None)  # noqa: E731
        out = {"integers": size("kq", "vq"), "scales": size("ks", "kz", "vs", "vz"), "residual": size("rk", "rv")}
        if self.koi is not None:
            out["outliers"] = size("koi", "kov", "voi", "vov")
        return out

    def _reserved_bytes(self) -> int:
        return sum(self.bytes_by_part().values())

    def _used_bytes(self, length: int) -> int:
        """Codes, scales and outliers of ``0..Q-1``, residual of ``Q..length-1``."""
        q, B, H = self.qf, self._batch, self.spec.kv_heads
        used = 0
        for part, width in (("k", self.spec.head_dim), ("v", self.spec.value_width)):
            used += sum(t[:, :, rows].nbytes for _, t, rows in self._rows(part, 0, q))
            used += B * H * (length - q) * width * self._dtype.itemsize
        return used

    def _slot_view(self, length: int) -> SlotView:
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
                                 quantized_upto=q, quantized_slots=nq, residual=list(range(nq, nq + r)),
                                 scheme=self.scheme())
        return SlotView(states, positions, sharers, layout)

    def scheme(self) -> str:
        """What this layer does beyond KIVI's defaults, in words ("" for keys per channel and values per token)."""
        k, v = self.kcodec, self.vcodec
        said = [*(["keys per token"] if k.axis == "token" else []),
                *(["values per channel"] if v.axis == "channel" else []),
                *(["pre-RoPE keys"] if k.pre_rope else []), *(["Hadamard-rotated"] if k.rotation is not None else []),
                *([f"{k.outliers} outliers a vector kept exact"] if k.outliers else []),
                *(["full-precision prefill"] if self.exact_prefill else [])]
        return ", ".join(said)

    def clone(self, memo: dict[int, Any], fork: bool = False) -> "QuantizedLayer":
        twin = shallow_copy(self)
        for name in self._tensors():
            setattr(twin, name, getattr(self, name).clone())
        return twin
