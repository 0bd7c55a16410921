"""A transformers causal LM as kvexplore sees it (:class:`HFModel`): the module, a kvexplore config, a tokenizer and,
where kvexplore implements the architecture, a kvexplore model on the same weights; an Executor a Generator drives."""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..config.model_config import ModelConfig
from ..errors import KVExploreError, LoadError, SettingsError
from ..formats.tokenizer import Tokenizer
from ..models.executor import ADAPTERS, Executor, register_adapter
from ..caches.registry import PREFIXES, register_prefix
from .cache import HFCache
from .caches import BOUNDED, is_transformers, make_hf_cache

SUPPORTED_TRANSFORMERS = "5.0"  # the oldest major version driven here (its Cache classes have .layers)


def _transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - an optional dependency
        raise SettingsError("driving a transformers model needs transformers: pip install 'kvexplore[hf]'") from e
    if int(transformers.__version__.split(".")[0]) < 5:
        raise SettingsError(f"transformers {transformers.__version__} is too old: kvexplore reads the per-layer "
                            f"caches of transformers >= {SUPPORTED_TRANSFORMERS}; pip install -U transformers")
    return transformers


def is_hf_model(obj: Any) -> bool:
    return is_transformers(obj, "PreTrainedModel")


class HFModel(Executor):
    """A transformers causal LM (eval mode) and what kvexplore needs around it.

    ``config`` is a kvexplore :class:`~kvexplore.ModelConfig`: the model's own when kvexplore implements the
    architecture (``supported``), otherwise one that describes its layers for the views only. ``tokenizer`` is a
    kvexplore :class:`~kvexplore.Tokenizer` (from a transformers tokenizer, a folder, or None: ids only).
    """

    def __init__(self, module: torch.nn.Module, tokenizer: Any = None, source: str = "") -> None:
        _transformers()
        if not is_hf_model(module) or not hasattr(module, "generate"):
            raise SettingsError(f"expected a transformers causal LM (AutoModelForCausalLM), "
                                f"got {type(module).__name__}")
        self.hf = module.eval()
        self.source = source or getattr(module.config, "_name_or_path", "") or type(module).__name__
        text = self.hf_config = module.config.get_text_config(decoder=True)
        try:
            self.config, self.supported = ModelConfig.from_hf(text.to_dict(), where=f"{self.source} config"), True
        except KVExploreError:
            self.config, self.supported = display_config(text, self.source), False
        self.tokenizer = as_tokenizer(tokenizer, self.config)
        self._twin = None
        params = inspect.signature(module.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf.parameters()).dtype

    @property
    def architecture(self) -> str:
        return type(self.hf).__name__

    def forward(self, ids: torch.Tensor, cache: Any, attention: bool = False, hidden: bool = False):
        """One forward pass of the transformers model over ``ids`` (1, T) with ``cache`` (None: no cache), as
        ``generate`` makes it: positions come from the cache's length."""
        kwargs: dict[str, Any] = {"use_cache": cache is not None}
        if cache is not None:
            kwargs[self._cache_arg] = cache
        if attention:
            kwargs["output_attentions"] = True
        if hidden:
            kwargs["output_hidden_states"] = True
        with torch.inference_mode():
            return self.hf(ids.to(self.device), **kwargs)

    def __call__(self, ids: torch.Tensor, cache, pos: int, tracer=None, last_only: bool = False,
                 keep_undo: bool = False) -> torch.Tensor:
        """The logits of one pass through ``cache`` (an :class:`~.cache.HFCache`), as kvexplore's
        :class:`~kvexplore.Model` is called by a Generator: the cache is read before and after, a tracer gets
        its hook points, and a pass that fails leaves the cache as it was."""
        from .step import feed_tracer, watching

        q_len = ids.shape[1]
        cache.begin_step(pos, q_len)
        wants = tracer is not None and any(tracer.wants_attention(i) for i in range(self.config.num_layers))
        try:
            with watching(cache.hf, pos, q_len, cache.window) as seen:
                if wants:
                    with self.eager():
                        out = self.forward(ids, cache.hf, attention=True)
                else:
                    out = self.forward(ids, cache.hf)
            logits = out.logits[:, -1:] if last_only else out.logits
            cache.end_step(pos, q_len, seen["reads"])
            if tracer is not None:
                feed_tracer(tracer, seen, out.attentions if wants else None, logits)
        except BaseException:
            cache.rollback()
            raise
        if not keep_undo:
            cache.settle()
        return logits.float()

    def check_cache(self, cache: Any) -> None:
        if not isinstance(cache, HFCache):
            raise SettingsError(f"cache must be a transformers cache (kvexplore.hf.make_cache), got "
                                f"{type(cache).__name__}")

    def default_cache(self) -> HFCache:
        return make_cache(self, "dynamic")

    def replay(self, ids, cache: HFCache) -> None:
        """Rebuild ``cache`` as a prefill of ``ids`` leaves it. A transformers cache takes positions from its own
        length, so the pass runs on a fresh copy first (a failure there leaves ``cache`` untouched); the cache
        then takes that copy's transformers cache and reads it as after any step."""
        if not ids:
            cache.truncate(0)
            return
        work = cache.clone()
        work.truncate(0)
        self(torch.tensor([list(ids)], dtype=torch.long), work, 0, last_only=True)
        reads = {i: r for i in range(len(work.plan)) if (r := work.read_positions(i))}
        cache.truncate(0)
        cache.hf = work.hf
        cache.end_step(0, len(ids), reads)

    @contextmanager
    def eager(self):
        """A context in which attention runs eagerly (its probabilities can be returned)."""
        before = getattr(self.hf.config, "_attn_implementation", None)
        if before != "eager":
            self.hf.set_attn_implementation("eager")
        try:
            yield
        finally:
            if before not in (None, "eager"):
                self.hf.set_attn_implementation(before)

    def twin(self):
        """A kvexplore :class:`~kvexplore.Model` on the same weights (built once; the weights are copied into
        kvexplore's layout). Raises UnsupportedModelError for an architecture kvexplore does not implement."""
        if self._twin is None:
            if not self.supported:
                from ..errors import UnsupportedModelError

                raise UnsupportedModelError(f"kvexplore does not implement {self.architecture}: only its transformers "
                                            f"caches (hf:dynamic, hf:static, ...) can run it")
            from ..formats.loading import assemble
            from ..formats.weights import expected_shapes

            state = self.hf.state_dict()
            names = expected_shapes(self.config)
            if missing := [n for n in names if n not in state]:
                raise LoadError(f"{self.source}: the transformers model has no tensor {missing[0]} that kvexplore's "
                                f"{self.config.architecture} expects")
            tensors = {n: state[n].detach().to(self.dtype).clone() for n in names}
            self._twin = assemble(self.config, tensors, self.tokenizer, self.device, self.source)
        return self._twin

    def __repr__(self) -> str:
        return (f"HFModel({self.architecture}, {self.config.num_layers} layers, "
                f"{str(self.dtype).removeprefix('torch.')})")


def display_config(text: Any, source: str) -> ModelConfig:
    """A kvexplore config that describes a model kvexplore does not run (GPT-2, ...): layers, heads, windows."""
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    hidden = int(text.hidden_size)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    window = getattr(text, "sliding_window", None)
    types = [t if t in ("full_attention", "sliding_attention") else "full_attention"
             for t in (getattr(text, "layer_types", None) or [])]
    sliding = window is not None and "sliding_attention" in types
    return ModelConfig(architecture="llama", vocab_size=int(text.vocab_size), hidden_size=hidden,
                       intermediate_size=int(getattr(text, "intermediate_size", None) or 4 * hidden),
                       num_layers=int(text.num_hidden_layers), num_heads=heads, num_kv_heads=kv,
                       head_dim=head_dim + head_dim % 2, sliding_window=window if sliding else None,
                       layer_types=types if sliding else [],
                       source=f"{source} (shown, not run, by kvexplore)")


def as_tokenizer(tokenizer: Any, config: ModelConfig) -> Tokenizer | None:
    """A kvexplore Tokenizer from a transformers tokenizer, a folder, a kvexplore Tokenizer or None."""
    if tokenizer is None or isinstance(tokenizer, Tokenizer):
        return tokenizer
    if isinstance(tokenizer, (str, Path)):
        return Tokenizer.from_folder(Path(tokenizer), config)
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    kind = "tokenizers"
    if backend is None and getattr(tokenizer, "sp_model", None) is not None:
        backend, kind = tokenizer.sp_model, "sentencepiece"
    if backend is None:
        raise SettingsError(f"cannot read the tokenizer {type(tokenizer).__name__}: give a transformers fast "
                            f"tokenizer, a sentencepiece one, or the model folder")
    eos = tokenizer.eos_token_id
    eos_ids = list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [int(eos)])
    return Tokenizer(backend, kind, tokenizer.bos_token_id, eos_ids, bool(getattr(tokenizer, "add_bos_token", False)),
                     getattr(tokenizer, "chat_template", None), tokenizer.bos_token or "", tokenizer.eos_token or "")


def load_hf(source: str | Path, dtype: str | torch.dtype | None = None, device: str | None = None) -> HFModel:
    """Load a folder (or a named kvexplore model: its converted folder) with transformers'
    ``AutoModelForCausalLM``, with its tokenizer read by kvexplore."""
    from ..core.devices import resolve_device
    from ..formats.loading import resolve_dtype
    from ..formats.store import MODELS, fetch

    transformers = _transformers()
    path = Path(source).expanduser()
    if isinstance(source, str) and source in MODELS and not path.exists():
        path = fetch(source)
    if not (path / "config.json").exists():
        raise LoadError(f"{source}: transformers loads a model folder with a config.json; give a Hugging Face style "
                        f"folder or a named model ({', '.join(MODELS)})")
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    module = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype).to(dev)
    model = HFModel(module, None, str(path))
    model.tokenizer = Tokenizer.from_folder(path, model.config)
    return model


# a Generator given a transformers module runs it through HFModel
register_adapter(is_hf_model, HFModel, name="transformers")
ADAPTERS.seal()  # built in, like kvexplore's own


PREFIX = "hf:"


def make_cache(model: HFModel, kind: str = "dynamic", max_seq_len: int | None = None) -> HFCache:
    """An :class:`HFCache` of transformers' cache ``kind`` (``"dynamic"``, ``"static"``, ...; see
    :data:`HF_CACHES`; an ``"hf:"`` prefix is accepted) for ``model``. ``max_seq_len`` sizes a static cache
    (default 256)."""
    if not isinstance(model, HFModel):
        raise SettingsError(f"transformers caches (hf:...) run on a transformers model: wrap it with "
                            f"kvexplore.hf.wrap(model, tokenizer), got {type(model).__name__}")
    name = kind.removeprefix(PREFIX)
    slots = 256 if max_seq_len is None else int(max_seq_len)
    fresh = lambda: make_hf_cache(name, model.hf, slots)  # noqa: E731
    return HFCache(PREFIX + name, fresh(), model.config, model.dtype, model.device,
                   slots if name in BOUNDED else None, fresh)


_make_cache = make_cache  # the "hf:" entry of kvexplore.make_cache (the prefix registry of kvexplore.caches.registry)
register_prefix(PREFIX, _make_cache)  # imported by kvexplore.hf, which kvexplore imports: always registered
PREFIXES.seal()  # "hf:" is built in
