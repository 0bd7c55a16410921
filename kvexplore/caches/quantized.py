"""KIVI: keys quantized per channel, values per token, the newest tokens kept in full precision.

Quantization is asymmetric min/max: ``code = round((x - zero) / scale)`` with ``zero = min`` and
``scale = (max - min) / (2**bits - 1)``, so ``|x - dequant(code)| <= scale / 2`` for every element. Keys take one
scale/zero per channel per *block* of ``group_size`` tokens; values one scale/zero per token per group of
``min(group_size, head_dim)`` channels. Codes are ``uint8``; 4-bit codes are packed two per byte along head_dim
(channel ``2i`` in the low nibble, ``2i + 1`` in the high one). Scales and zeros are float32 whatever the dtype.
"""

from __future__ import annotations

import torch

from ..config.model_config import ModelConfig
from ..core.settings import integer, positive_int
from ..core import host
from ..errors import CacheFullError, SettingsError
from .memory import StepCounters
from .base import FILLED, FREE, STALE, KVCache, SlotView
from .layout import QuantizedLayout

F32 = torch.float32


def _minmax(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (uint8, unpacked), scale and zero of float32 ``x`` quantized over ``dim`` (kept as size 1)."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = (hi - lo) / (2 ** bits - 1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: every code is 0, exact
    return ((x - lo) / safe).round_().clamp_(0, 2 ** bits - 1).to(torch.uint8), scale, lo


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """8-bit codes as they are; 4-bit codes two per byte along the last dim: ``(..., D) -> (..., D // 2)``."""
    return q if bits == 8 else q[..., 0::2] | (q[..., 1::2] << 4)


def unpack(p: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``(..., D * bits // 8) -> (..., D)`` uint8 codes."""
    return p if bits == 8 else torch.stack([p & 15, p >> 4], dim=-1).flatten(-2)


def quantize_keys(k: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys ``(B, H, n * G, D)``, per channel over blocks of ``G`` tokens -> packed codes ``(B, H, n * G,
    D * bits // 8)``, scale and zero ``(B, H, n, D)``."""
    B, H, T, D = k.shape
    q, s, z = _minmax(k.to(F32).reshape(B, H, T // group_size, group_size, D), 3, bits)
    return pack(q.view(B, H, T, D), bits), s.squeeze(3), z.squeeze(3)


def dequantize_keys(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Float32 keys ``(B, H, n * G, D)`` from :func:`quantize_keys` output."""
    B, H, n, D = scale.shape
    q = unpack(codes, bits).view(B, H, n, -1, D).to(F32)  # (B, H, n, G, D)
    return (q * scale.unsqueeze(3) + zero.unsqueeze(3)).view(B, H, -1, D)


def quantize_values(v: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values ``(B, H, T, D)``, per token over groups of ``group`` channels -> packed codes ``(B, H, T,
    D * bits // 8)``, scale and zero ``(B, H, T, D // group)``."""
    B, H, T, D = v.shape
    q, s, z = _minmax(v.to(F32).reshape(B, H, T, D // group, group), 4, bits)
    return pack(q.view(B, H, T, D), bits), s.squeeze(4), z.squeeze(4)


def dequantize_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Float32 values ``(B, H, T, D)`` from :func:`quantize_values` output."""
    B, H, T, g = scale.shape
    q = unpack(codes, bits).view(B, H, T, g, -1).to(F32)  # (B, H, T, groups, group)
    return (q * scale.unsqueeze(4) + zero.unsqueeze(4)).view(B, H, T, -1)


class QuantizedCache(KVCache):
    """KIVI cache: positions ``0..Q-1`` quantized, ``Q..length-1`` in full precision (the residual).

    The quantized frontier ``Q`` is a multiple of ``G = group_size``; after a write it advances to the largest
    multiple of ``G`` with ``Q <= length - residual``, so the residual holds between ``residual`` and
    ``residual + G - 1`` positions (fewer while the sequence is short). Keys and values share the frontier.

    Storage per layer (B batch, H kv heads, D head dim, ``Nq = max_seq_len // G * G`` quantizable slots,
    ``Nr = min(max_seq_len, residual + G - 1)`` residual slots, ``gv = min(G, D)``, e = dtype element size)::

        integers  k, v codes   uint8   (B, H, Nq, D * bits // 8)       2 * B*H*Nq*D*bits/8
        scales    k scale/zero float32 (B, H, Nq // G, D)              2 * 4 * B*H*(Nq/G)*D
                  v scale/zero float32 (B, H, Nq, D // gv)             2 * 4 * B*H*Nq*(D/gv)
        residual  k, v         dtype   (B, H, Nr, D)                   2 * e * B*H*Nr*D

    ``reserved_bytes`` = layers * (integers + scales + residual), see :meth:`bytes_breakdown`. The per-position
    error diagnostics (2 float32 ``(B, H, max_seq_len)`` per layer) are not counted there: see
    ``diagnostic_bytes``. Positions past ``Nq`` (a trailing partial block) are never quantized.

    Rewinds: positions ``>= n`` are dropped. Whole blocks before ``n`` stay quantized untouched; the block that
    straddles ``n`` (if quantized) is dequantized into the residual and ``Q`` drops to ``n // G * G``: its kept
    positions hold their dequantized values (the originals are gone) and are quantized again when the block
    leaves the window, so their recorded error becomes the sum of both (an upper bound on the true error).
    A rewind that stays inside the residual (``n >= Q``) loses nothing: the kept positions are held exactly as
    before. ``Q`` never moves back further than the straddling block (the originals of quantized blocks are
    gone), so regenerated positions may read quantized what was full precision when they were first written:
    bit-for-bit the same only if ``Q`` has not advanced since position ``n`` was first written; otherwise
    close, and deterministic (the same rewind and writes on a copy give the same cache). A write at
    ``pos < length`` rewinds to ``pos`` first, the same way. A forward pass that fails (in the model or after
    it) is rolled back exactly: each write keeps the slots, codes and scales it is about to change, so
    :meth:`rollback` puts the storage back bit for bit (the residual and one block when blocks leave the window).

    ``write`` returns what the cache holds after the write: the quantized positions dequantized (in the
    dtype), then the residual; a chunk long enough to push blocks out of the window is read dequantized too.
    """

    kind = "quantized"

    def __init__(self, config: ModelConfig, max_seq_len: int, bits: int = 8, group_size: int = 32,
                 residual: int = 32, batch_size: int = 1, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None) -> None:
        max_seq_len = positive_int(max_seq_len, "max_seq_len")
        if integer(bits, "bits") not in (4, 8):
            raise SettingsError(f"bits must be 4 or 8, got {bits}")
        group_size, residual = positive_int(group_size, "group_size"), integer(residual, "residual", minimum=0)
        super().__init__(config, batch_size, dtype or torch.float32, device or "cpu")
        if any(self.plan[i].latent for i in self.full_layers):
            raise SettingsError("the quantized cache stores keys and values of one width; an MLA model's latent cache "
                                "(DeepSeek) stores a latent and a rope key instead: use preallocated, concat, paged "
                                "or none")
        for D in sorted({self.plan[i].head_dim for i in self.full_layers}):
            if D % min(group_size, D) or D % 2:
                raise SettingsError(f"head_dim {D} must be even and a multiple of the value group "
                                    f"{min(group_size, D)}; pick a group_size that divides it")
        self.bits, self.group_size, self.residual = bits, group_size, residual
        self._capacity = max_seq_len
        self._nq = max_seq_len // group_size * group_size  # quantizable slots: whole blocks only
        self._nr = min(max_seq_len, residual + group_size - 1)  # residual slots
        B, G, nq, nr = batch_size, group_size, self._nq, self._nr

        def zeros(shape, dtype: torch.dtype = F32) -> list[torch.Tensor | None]:
            """One tensor per full layer, of ``shape(kv_heads, head_dim)``."""
            return self._per_full_layer(lambda i: torch.zeros(
                shape(self.plan[i].kv_heads, self.plan[i].head_dim), dtype=dtype, device=self.device))

        self._kq = zeros(lambda H, D: (B, H, nq, D * bits // 8), torch.uint8)
        self._vq = zeros(lambda H, D: (B, H, nq, D * bits // 8), torch.uint8)
        self._ks, self._kz = zeros(lambda H, D: (B, H, nq // G, D)), zeros(lambda H, D: (B, H, nq // G, D))
        self._vs = zeros(lambda H, D: (B, H, nq, D // min(G, D)))
        self._vz = zeros(lambda H, D: (B, H, nq, D // min(G, D)))
        self._rk, self._rv = zeros(lambda H, D: (B, H, nr, D), self.dtype), zeros(lambda H, D: (B, H, nr, D), self.dtype)
        self._kerr = zeros(lambda H, D: (B, H, max_seq_len))  # max abs error per position
        self._verr = zeros(lambda H, D: (B, H, max_seq_len))
        self._qf = [0] * config.num_layers  # quantized frontier per full layer (equal after every commit/truncate)
        self._q_high = self._r_high = 0  # slots below these were written at some point

    @property
    def quantized_upto(self) -> int:
        """The frontier ``Q``: positions ``0..Q-1`` are quantized."""
        return self._qf[self.full_layers[0]] if self.full_layers else 0

    def value_group(self, layer: int) -> int:
        """Channels per value scale in ``layer``: ``min(group_size, head_dim)``."""
        return min(self.group_size, self.plan[layer].head_dim)

    def check_write(self, pos: int, q_len: int, batch_size: int) -> None:
        super().check_write(pos, q_len, batch_size)
        if pos + q_len > self.capacity:
            raise CacheFullError(used=pos, needed=q_len, capacity=self.capacity)

    _LAYER_STATE = ("_kq", "_vq", "_ks", "_kz", "_vs", "_vz", "_rk", "_rv", "_kerr", "_verr")

    def _snapshot(self) -> dict:
        return {**super()._snapshot(), "_qf": list(self._qf), "_q_high": self._q_high, "_r_high": self._r_high}

    def _restore(self, snapshot: dict) -> None:
        super()._restore({**snapshot, "_qf": list(snapshot["_qf"])})

    def _write(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        G, step = self.group_size, self._step
        end = pos + k.shape[2]
        rewrites = pos < self.undo_length  # a write before the end rewrites held codes and residual
        if rewrites:  # keep the whole layer
            for name in self._LAYER_STATE:
                t = getattr(self, name)[layer]
                self._keep(t, 2, 0, t.shape[2])
        if pos < self._qf[layer]:
            step.copied_bytes += self._unquantize_tail(layer, pos)
        qf = self._qf[layer]
        new_qf = min(self._nq, max(qf, (end - self.residual) // G * G))
        if not rewrites:
            self._keep_touched(layer, pos, end, qf, new_qf)
        rk, rv = self._rk[layer], self._rv[layer]
        self._kerr[layer][:, :, pos:end] = 0
        self._verr[layer][:, :, pos:end] = 0
        if new_qf == qf:  # everything new goes to the residual, in place
            rk[:, :, pos - qf:end - qf] = k
            rv[:, :, pos - qf:end - qf] = v
            step.written_bytes += k.nbytes + v.nbytes
        else:  # blocks leave the window: quantize them, keep the rest of old residual + new as the residual
            fk = torch.cat([rk[:, :, :pos - qf], k.to(self.dtype)], 2)  # positions qf..end-1
            fv = torch.cat([rv[:, :, :pos - qf], v.to(self.dtype)], 2)
            n = new_qf - qf
            self._quantize(layer, qf, fk[:, :, :n], fv[:, :, :n])
            keep, moved = end - new_qf, max(0, pos - new_qf)  # moved: old residual positions shifted down
            rk[:, :, :keep] = fk[:, :, n:]
            rv[:, :, :keep] = fv[:, :, n:]
            per_token = 2 * k.shape[0] * k.shape[1] * k.shape[3] * rk.element_size()
            step.copied_bytes += moved * per_token
            step.written_bytes += (keep - moved) * per_token
            self._qf[layer] = new_qf
        self._q_high = max(self._q_high, new_qf)
        self._r_high = max(self._r_high, end - new_qf)
        return self._read(layer, end)

    def _keep_touched(self, layer: int, pos: int, end: int, qf: int, new_qf: int) -> None:
        """Keep every slot a write of ``pos..end-1`` at the end of the sequence touches, so a rollback restores
        the storage bit for bit: the error records and the residual slots written, or, when blocks leave the
        window (``new_qf > qf``), the whole residual (it shifts down) and the codes and scales of those blocks."""
        G = self.group_size
        for t in (self._kerr[layer], self._verr[layer]):
            self._keep(t, 2, pos, end - pos)
        if new_qf == qf:
            for t in (self._rk[layer], self._rv[layer]):
                self._keep(t, 2, pos - qf, end - pos)
            return
        for t in (self._rk[layer], self._rv[layer]):
            self._keep(t, 2, 0, t.shape[2])
        for name in ("_kq", "_vq", "_vs", "_vz", "_kerr", "_verr"):
            self._keep(getattr(self, name)[layer], 2, qf, new_qf - qf)
        for name in ("_ks", "_kz"):
            self._keep(getattr(self, name)[layer], 2, qf // G, (new_qf - qf) // G)

    def _read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values ``(B, H, end, D)`` in the dtype: dequantized ``0..Q-1``, then the residual (views)."""
        qf = self._qf[layer]
        rk, rv = self._rk[layer].narrow(2, 0, end - qf), self._rv[layer].narrow(2, 0, end - qf)
        if qf == 0:
            return rk, rv
        G, b = self.group_size, self.bits
        kd = dequantize_keys(self._kq[layer][:, :, :qf], self._ks[layer][:, :, :qf // G],
                             self._kz[layer][:, :, :qf // G], b)
        vd = dequantize_values(self._vq[layer][:, :, :qf], self._vs[layer][:, :, :qf], self._vz[layer][:, :, :qf], b)
        return torch.cat([kd.to(self.dtype), rk], 2), torch.cat([vd.to(self.dtype), rv], 2)

    def _quantize(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize whole blocks ``k``/``v`` ``(B, H, n * G, D)`` holding positions ``start..``; record errors."""
        G, b, end = self.group_size, self.bits, start + k.shape[2]
        kc, ks, kz = quantize_keys(k, b, G)
        vc, vs, vz = quantize_values(v, b, self.value_group(layer))
        self._kq[layer][:, :, start:end], self._vq[layer][:, :, start:end] = kc, vc
        self._ks[layer][:, :, start // G:end // G], self._kz[layer][:, :, start // G:end // G] = ks, kz
        self._vs[layer][:, :, start:end], self._vz[layer][:, :, start:end] = vs, vz
        self._kerr[layer][:, :, start:end] += (dequantize_keys(kc, ks, kz, b) - k.to(F32)).abs().amax(-1)
        self._verr[layer][:, :, start:end] += (dequantize_values(vc, vs, vz, b) - v.to(F32)).abs().amax(-1)
        self._step.written_bytes += sum(t.nbytes for t in (kc, ks, kz, vc, vs, vz))

    def _unquantize_tail(self, layer: int, n: int) -> int:
        """Drop positions ``>= n`` of a layer whose frontier is past ``n``: the straddling block's positions
        below ``n`` move, dequantized, into the residual. Returns the bytes written there."""
        G, b = self.group_size, self.bits
        start = n // G * G
        if n > start:
            block = slice(start // G, start // G + 1)
            kd = dequantize_keys(self._kq[layer][:, :, start:start + G], self._ks[layer][:, :, block],
                                 self._kz[layer][:, :, block], b)[:, :, :n - start]
            vd = dequantize_values(self._vq[layer][:, :, start:n], self._vs[layer][:, :, start:n],
                                   self._vz[layer][:, :, start:n], b)
            self._rk[layer][:, :, :n - start] = kd
            self._rv[layer][:, :, :n - start] = vd
        self._qf[layer] = start
        return 2 * self._rk[layer][:, :, :n - start].nbytes

    def truncate(self, n: int) -> None:
        """Keep positions ``0..n-1`` (see the class docstring for what happens inside a quantized block).

        Truncated in the middle of a forward pass (some layers written, a failed pass rolls back instead), the
        layers written may have advanced their frontier: the others are brought to the same frontier (quantizing
        kept positions, exactly as the retry of the pass would), so every layer holds the same layout again."""
        super().truncate(n)
        for layer in self.full_layers:
            if self._qf[layer] > n:
                self._unquantize_tail(layer, n)
        target = max((self._qf[i] for i in self.full_layers), default=0)
        for layer in self.full_layers:
            qf = self._qf[layer]
            if qf < target:  # positions qf..target-1 < n are valid in this layer's residual
                rk, rv = self._rk[layer], self._rv[layer]
                self._quantize(layer, qf, rk[:, :, :target - qf], rv[:, :, :target - qf])
                rk[:, :, :n - target] = rk[:, :, target - qf:n - qf].clone()
                rv[:, :, :n - target] = rv[:, :, target - qf:n - qf].clone()
                self._qf[layer] = target
        self._step = StepCounters()

    def quantization_error(self, layer: int, part: str = "kv") -> torch.Tensor:
        """Max abs error ``|x - dequant(quant(x))|`` over head_dim, ``(B, H, length)`` float32, for ``part``
        ``"k"``, ``"v"`` or ``"kv"`` (the larger of both). 0 for positions that never left full precision."""
        n = self.length
        k, v = self._kerr[layer][:, :, :n], self._verr[layer][:, :, :n]
        chosen = {"k": k, "v": v, "kv": torch.maximum(k, v)}
        if part not in chosen:
            raise SettingsError(f"part must be 'k', 'v' or 'kv', got {part!r}")
        return chosen[part].clone()

    def stored_error(self, layer: int) -> torch.Tensor | None:
        if layer not in self.full_layers:  # a ring or a shared layer stores exactly
            return None
        return host.fetch([self.quantization_error(layer)[0].float()])[0]

    def _storage(self, layer: int) -> list[torch.Tensor]:
        return [self._rk[layer], self._rv[layer]]  # a read is a view of these only while nothing is quantized

    def _slot_view(self) -> SlotView:
        """The ``Nq`` quantized slots, then the ``Nr`` full-precision residual slots."""
        q, n, nq, nr = self.quantized_upto, self.length, self._nq, self._nr
        r = n - q
        qh, rh = max(q, self._q_high), max(r, self._r_high)
        states = ([FILLED] * q + [STALE] * (qh - q) + [FREE] * (nq - qh)
                  + [FILLED] * r + [STALE] * (rh - r) + [FREE] * (nr - rh))
        positions = list(range(q)) + [-1] * (nq - q) + list(range(q, n)) + [-1] * (nr - r)
        sharers = [1] * q + [0] * (nq - q) + [1] * r + [0] * (nr - r)
        layout = QuantizedLayout(bits=self.bits, group_size=self.group_size, residual_window=self.residual,
                                 quantized_upto=q, quantized_slots=nq, residual=list(range(nq, nq + r)))
        return SlotView(states, positions, sharers, layout)

    def _clone_storage(self, twin: "QuantizedCache") -> None:
        for name in self._LAYER_STATE:
            setattr(twin, name, [None if t is None else t.clone() for t in getattr(self, name)])
        twin._qf = list(self._qf)

    def bytes_breakdown(self) -> dict[str, int]:
        """Bytes of storage held, by part: integer codes, scales + zeros, full-precision residual."""
        def size(*names: str) -> int:
            return sum(t.nbytes for name in names for t in getattr(self, name) if t is not None)
        return {"integers": size("_kq", "_vq"), "scales": size("_ks", "_kz", "_vs", "_vz"),
                "residual": size("_rk", "_rv")}

    @property
    def full_reserved_bytes(self) -> int:
        return sum(self.bytes_breakdown().values())

    def full_layer_reserved(self, layer: int) -> int:
        return sum(getattr(self, name)[layer].nbytes for name in self._LAYER_STATE[:8])

    @property
    def diagnostic_bytes(self) -> int:
        """Bytes of the per-position error records (not part of ``reserved_bytes``)."""
        return sum(t.nbytes for t in (*self._kerr, *self._verr) if t is not None)

    def full_layer_used(self, layer: int) -> int:
        """Bytes of ``layer`` holding the ``length`` positions: codes and scales of ``0..Q-1``, residual of
        ``Q..length-1``."""
        q, G, spec = self._qf[layer], self.group_size, self.plan[layer]
        bhd = self.batch_size * spec.kv_heads * spec.head_dim
        codes = 2 * bhd * q * self.bits // 8
        scales = 2 * 4 * bhd * (q // G + q // self.value_group(layer))
        residual = 2 * bhd * (self.length - q) * self.dtype.itemsize
        return codes + scales + residual
