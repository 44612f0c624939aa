"""One shared backbone with named LoRA adapters: the student, the composer's encoder and the teacher.

LOPD runs three roles on one causal LM (docs/METHOD.md sections 3 and 4): the student pi_S (weights theta),
the composer's encoder Enc_psi (the backbone with its own LoRA psi) and the self-teacher pi_theta_bar.
Nothing is copied: :func:`prepare_backbone` wraps the model once with peft and gives it the adapters
(a full-parameter student of a method without a composer has none and stays a plain model):

- ``"student"``: the student's LoRA, when the student is trained with LoRA; with a full-parameter student
  there is no such adapter and the student is the base weights (adapters disabled);
- ``"composer"``: the encoder's LoRA psi (rank 8, alpha 16, dropout 0 on q, k, v, o, gate, up, down),
  only for a method with a composer (LOPD adds it with :func:`add_composer_adapter` after the base module
  built the student's backbone): the other methods have no composer parameter at all;
- ``"teacher_ema"``: added later by :class:`lopd_lightning.teacher.SelfTeacher` in ``ema`` mode.

:func:`use_adapter` selects which one a forward pass sees. peft's own ``set_adapter`` /
``enable_adapter_layers`` flip ``requires_grad`` (the active adapter becomes trainable, all others frozen);
:func:`use_adapter` calls them and then puts every flag back, so the flags are what the caller set, during
and after the context. Which parameters a pass may send gradients to is chosen separately with ``grads``:

- ``"keep"`` (the student pass): the flags as they are;
- ``"adapter"`` (the composer's encoder pass): only the active adapter's parameters keep their flags;
  every other backbone parameter (base weights, other adapters) has ``requires_grad`` off *while the
  forward runs*;
- ``"none"`` (the teacher pass): every backbone parameter is off while the forward runs; gradients can
  only reach the inputs (the latent tokens).

Why turning ``requires_grad`` off during the forward is enough: autograd records the graph while the
forward runs; a parameter that does not require grad at that moment is a constant of that graph, and
the later ``backward()`` (after the context has restored the flag) gives it no gradient. This is what
keeps a full-parameter student's base weights (which require grad for the student) free of gradients
from the composer and teacher passes, without detaching or copying anything.

A pass's backward usually runs after :func:`use_adapter` has switched back; with activation
checkpointing its layers are recomputed then, under the state of their forward
(:mod:`lopd_lightning.checkpointing`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from lopd_lightning.hints import did_you_mean
from lopd_lightning.tied_weights import check_tied_lora, untie_lora_weights

STUDENT = "student"
COMPOSER = "composer"
TEACHER_EMA = "teacher_ema"

#: Target modules of the default LoRAs (docs/METHOD.md section 3): attention and MLP projections.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

GradMode = Literal["keep", "adapter", "none"]

__all__ = [
    "COMPOSER",
    "LORA_TARGETS",
    "STUDENT",
    "TEACHER_EMA",
    "add_composer_adapter",
    "adapter_names",
    "adapter_parameters",
    "as_lora_config",
    "base_parameters",
    "check_lora_config",
    "composer_lora_parameters",
    "copy_adapter",
    "merged_student",
    "default_lora_config",
    "frozen",
    "is_lora_student",
    "parameter_storage",
    "prepare_backbone",
    "student_adapter_name",
    "student_parameters",
    "TunerState",
    "tuner_layers",
    "tuner_states",
    "use_adapter",
]


def default_lora_config(
    *, r: int = 8, lora_alpha: int = 16, lora_dropout: float = 0.0, target_modules: tuple[str, ...] = LORA_TARGETS
) -> LoraConfig:
    """A causal-LM LoRA config; the defaults are the composer's encoder LoRA (docs/METHOD.md section 3).

    Returns:
        ``LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=[q,k,v,o,gate,up,down], bias="none")``.
    """
    return LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=list(target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def as_lora_config(
    config: LoraConfig | dict[str, Any] | None, *, default: LoraConfig | None = None, key: str = "lora"
) -> LoraConfig | None:
    """A ``LoraConfig`` from a config or its keyword arguments (``task_type`` defaults to ``"CAUSAL_LM"``);
    ``default`` for None.

    Args:
        key: the config's name under ``model.init_args`` (``"lora"``, ``"composer_lora"``), for errors.

    Raises:
        TypeError: ``config`` is neither a ``LoraConfig``, a dict nor None.
        ValueError: a key of the dict is not a ``LoraConfig`` field (the message names the closest one); a
            value peft's ``LoraConfig`` refuses, a rank ``r`` below 1 or a ``lora_dropout`` outside [0, 1]
            (peft checks those two only when it wraps the layers, after the weights loaded); the message
            names ``model.init_args.<key>.<field>``.
    """
    import dataclasses
    import re

    def checked(lora: LoraConfig) -> LoraConfig:
        r, dropout = lora.r, lora.lora_dropout
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"model.init_args.{key}.r must be a positive integer (the LoRA rank, e.g. 8), got {r!r}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout <= 1.0:
            raise ValueError(
                f"model.init_args.{key}.lora_dropout must be a probability in [0, 1] (e.g. 0.05), got {dropout!r}"
            )
        return lora

    if config is None:
        return default
    if isinstance(config, LoraConfig):
        return checked(config)
    if isinstance(config, dict):
        fields = {f.name for f in dataclasses.fields(LoraConfig) if f.init}
        for name in config:
            if name not in fields:
                hint = did_you_mean(name, sorted(fields), quote=True) or "; LoRA fields include r, lora_alpha, lora_dropout, target_modules"
                raise ValueError(f"model.init_args.{key}.{name} is not a LoraConfig field{hint}")
        kwargs = dict(config)
        if "target_modules" in kwargs and isinstance(kwargs["target_modules"], tuple):
            kwargs["target_modules"] = list(kwargs["target_modules"])
        kwargs.setdefault("task_type", "CAUSAL_LM")
        try:
            lora = LoraConfig(**kwargs)
        except (ValueError, TypeError) as error:  # peft's own checks of the fields (its __post_init__)
            message = " ".join(str(error).split())
            named = [n for n in config if re.search(rf"(?<![\w.]){re.escape(str(n))}(?!\w)", message)]
            where = f"model.init_args.{key}.{named[0]}" if len(named) == 1 else f"model.init_args.{key}"
            raise ValueError(f"{where}: {message} (peft's LoraConfig refused it; fix or remove the value)") from error
        return checked(lora)
    raise TypeError(
        f"model.init_args.{key} must be a dict of LoraConfig arguments, a LoraConfig or null, got {type(config).__name__}"
    )


def prepare_backbone(
    model: nn.Module,
    *,
    student_lora: LoraConfig | dict[str, Any] | None,
    composer_lora: LoraConfig | dict[str, Any] | None = None,
) -> nn.Module:
    """Wrap a causal LM once with the named adapters ``"student"`` and ``"composer"``, each optional.

    Args:
        model: a Hugging Face causal LM (not yet a ``PeftModel``). It is modified in place (LoRA layers are
            injected) and becomes the base model of the returned ``PeftModel``: its weights are not copied.
        student_lora: the student's LoRA (a ``LoraConfig`` or its keyword arguments), or ``None`` for a
            full-parameter student: then there is no ``"student"`` adapter and the base weights keep the
            ``requires_grad`` flags they had before wrapping (trainable, for the student).
        composer_lora: the encoder's LoRA psi (a ``LoraConfig`` or its keyword arguments; the paper's is
            :func:`default_lora_config`), or ``None`` for a method without a composer: then there is no
            ``"composer"`` adapter and no composer parameter at all (a parameter that never receives a
            gradient would break DDP's gradient all-reduce). The same as calling
            :func:`add_composer_adapter` on the result.

    Returns:
        The ``PeftModel`` with the adapters asked for; with neither (a full-parameter student of a method
        without a composer) ``model`` itself, unwrapped. Flags after the call: adapter parameters
        trainable; base weights frozen for a LoRA student, as before wrapping for a full student. The
        active adapter is ``"student"`` (LoRA student) or ``"composer"`` with all adapters disabled (full
        student), so a plain ``backbone(...)`` call is the student's forward either way.

    Raises:
        TypeError: ``model`` is already a ``PeftModel`` or a config has the wrong type.
        ValueError: a config asks for what one shared backbone cannot honour (:func:`check_lora_config`); the
            student LoRA targets a weight tied other than as the word embeddings
            (:func:`~lopd_lightning.tied_weights.check_tied_lora`; a LoRA on tied embeddings or head is fine:
            :func:`merged_student` unties it).
    """
    if isinstance(model, PeftModel):
        raise TypeError("prepare_backbone expects a plain model; it is already a PeftModel")
    student_cfg = as_lora_config(student_lora, key="lora")
    composer_cfg = as_lora_config(composer_lora, key="composer_lora")
    check_lora_config(student_cfg, "lora", model=model)
    check_lora_config(composer_cfg, "composer_lora", model=model)
    backbone = model
    if student_cfg is not None:
        backbone = get_peft_model(model, student_cfg, adapter_name=STUDENT)
        check_tied_lora(backbone, STUDENT, "lora")
        for p in base_parameters(backbone):
            p.requires_grad_(False)
        for p in adapter_parameters(backbone, STUDENT):
            p.requires_grad_(True)
    return backbone if composer_cfg is None else add_composer_adapter(backbone, composer_cfg)


def add_composer_adapter(backbone: nn.Module, config: LoraConfig | dict[str, Any], *, name: str = COMPOSER) -> nn.Module:
    """Give the shared backbone the composer's encoder LoRA psi (adapter ``name``, default ``"composer"``).

    A method with a composer (LOPD) calls it once after the base module has built the student's backbone
    (:func:`prepare_backbone` without ``composer_lora``). It handles both students:

    * a LoRA student (a ``PeftModel`` with the ``"student"`` adapter): ``add_adapter``; the active
      adapter stays ``"student"`` and the base weights keep their flags (frozen);
    * a full-parameter student (a plain model): the model is wrapped in a ``PeftModel`` whose only adapter
      is the composer's, with all adapters disabled (a plain call is the student's forward) and the base
      weights keeping the ``requires_grad`` flags they had.

    Either way every adapter's parameters are trainable afterwards: the same flags, active adapter and
    random LoRA initialisation (drawn from the global torch generator at this call) as
    ``prepare_backbone(model, student_lora=..., composer_lora=config)`` gives.

    Args:
        backbone: the student's backbone from :func:`prepare_backbone` (plain model or ``PeftModel``).
        config: the composer LoRA (a ``LoraConfig`` or its keyword arguments, ``model.init_args.composer_lora``;
            the paper's is :func:`default_lora_config`).
        name: the adapter's name.

    Returns:
        The backbone with the adapter: the same ``PeftModel`` for a LoRA student, a new ``PeftModel``
        around ``backbone`` (modified in place, not copied) for a full student. Keep the returned object.

    Raises:
        TypeError: ``config`` is not a ``LoraConfig``, a dict or None.
        ValueError: ``config`` is None or cannot be honoured (:func:`check_lora_config`), or the backbone
            already has an adapter ``name``.

    Source: docs/METHOD.md section 3, the encoder Enc_psi: the shared backbone with its own LoRA psi.
    """
    cfg = as_lora_config(config, key="composer_lora")
    if cfg is None:
        raise ValueError("add_composer_adapter needs a LoRA config (model.init_args.composer_lora)")
    if name in adapter_names(backbone):
        raise ValueError(f"the backbone already has an adapter {name!r}")
    check_lora_config(cfg, "composer_lora", model=backbone)
    base_flags = {id(p): p.requires_grad for p in backbone.parameters()}  # peft keeps these tensors as they are
    if isinstance(backbone, PeftModel):
        prev_active, prev_disabled = _current_state(backbone)
        backbone.add_adapter(name, cfg)
        layers = tuner_layers(backbone)  # after the adapter was added: it may have injected layers
        _switch(backbone, prev_active, layers)  # the student's adapter stays the active one
        if prev_disabled:
            _switch(backbone, None, layers)
    else:
        backbone = get_peft_model(backbone, cfg, adapter_name=name)
        backbone.base_model.disable_adapter_layers()
    for p in base_parameters(backbone):  # restore the flags the base weights had before peft froze them
        p.requires_grad_(base_flags.get(id(p), True))
    for adapter in adapter_names(backbone):
        for p in adapter_parameters(backbone, adapter):
            p.requires_grad_(True)
    return backbone


#: LoraConfig fields that add trainable copies or tokens outside the LoRA layers. One backbone shares
#: its base weights between the student, the composer and the teacher, and this module trains, saves
#: and switches only LoRA layers: such a copy would be counted as a base weight and stay frozen.
_UNSUPPORTED_LORA_FIELDS = ("modules_to_save", "trainable_token_indices")


def check_lora_config(config: LoraConfig | None, key: str, *, model: nn.Module | None = None) -> None:
    """Refuse a LoRA config that the shared backbone cannot honour, with one line naming the field.

    Args:
        config: the config (None: nothing to check).
        key: its name under ``model.init_args`` (``"lora"`` for the student, ``"composer_lora"``).
        model: the model the config will wrap (plain, or a ``PeftModel`` that already has other adapters);
            when given, ``target_modules`` must name modules it has and that peft's LoRA supports (linear,
            embedding or convolution layers).

    Raises:
        ValueError: ``modules_to_save`` or ``trainable_token_indices`` is set (a copy of the module
            outside LoRA, which would stay frozen and be shared by every role); ``target_modules`` names
            no module of ``model`` or a module type LoRA cannot wrap.
    """
    if config is None:
        return
    for field in _UNSUPPORTED_LORA_FIELDS:
        if getattr(config, field, None):
            raise ValueError(
                f"model.init_args.{key}.{field}={getattr(config, field)!r} is not supported: the copy it makes "
                f"would be frozen and shared by the student, composer and teacher; remove {field} (to train "
                f"that module, add it to target_modules for a LoRA on it, or set model.init_args.lora to null "
                f"for a full-parameter student)"
            )
    if model is None or config.target_modules is None or isinstance(config.target_modules, str):
        return  # a regex string or peft's own default: left to peft
    wanted = set(config.target_modules)
    supported = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d)
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):  # a layer already wrapped by another adapter: judge what it wraps
            module = module.get_base_layer()
        for target in wanted:  # peft's rule: the whole name, or its dotted suffix
            if name == target or name.endswith("." + target):
                if not isinstance(module, supported) and type(module).__name__ != "Conv1D":
                    raise ValueError(
                        f"model.init_args.{key}.target_modules names {target!r}, a {type(module).__name__}, which "
                        f"LoRA cannot wrap; name linear or embedding layers (e.g. {list(LORA_TARGETS)})"
                    )
                found[target] = type(module).__name__
    missing = sorted(wanted - set(found))
    if missing:
        raise ValueError(
            f"model.init_args.{key}.target_modules names {missing}, which this model does not have; "
            f"choose among its layers, e.g. {list(LORA_TARGETS)}"
        )


def tuner_layers(model: nn.Module) -> list[BaseTunerLayer]:
    """The peft adapter layers (``BaseTunerLayer``) inside ``model``, in module order ([] for a plain model):
    where the active adapter, the disabled flag and the scaling that decide a forward live."""
    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


#: one peft adapter layer's forward-deciding state (:func:`tuner_states`)
TunerState = tuple[str | list[str], bool, dict[str, float], tuple[str, ...]]


def tuner_states(modules: Iterable[nn.Module]) -> list[TunerState]:
    """The adapter selection and scaling that decide the forward of each peft adapter layer
    (``BaseTunerLayer``) among ``modules``, in their order (``[]`` when none is one), read in one pass.

    Per layer (with its weights, its input and its modules' train flags, what decides its forward): its
    active adapter(s) (a copy, a name or a list as peft holds it), its disabled flag, its scaling per
    adapter (a copy) and its merged adapters. Compared with ``==``. Read by activation checkpointing (a
    decoder layer's, at every checkpointed forward, to recompute under the forward's state) and by the
    prefix cache's weights stamp (a whole model's, ``model.modules()``, at every ``generate`` call of a
    rollout session, to drop rows computed under another state): one call each, not one per layer.
    """
    return [
        (layer._active_adapter if isinstance(layer._active_adapter, str) else list(layer._active_adapter),
         bool(layer._disable_adapters), dict(getattr(layer, "scaling", {})), tuple(layer.merged_adapters))
        for layer in modules if isinstance(layer, BaseTunerLayer)
    ]


def adapter_names(peft_model: nn.Module) -> list[str]:
    """Names of the adapters on the backbone, in insertion order (``peft_config`` keys; [] for a plain model)."""
    return list(getattr(peft_model, "peft_config", {}).keys())


def is_lora_student(peft_model: nn.Module) -> bool:
    """True when the backbone has a ``"student"`` adapter (the student is LoRA-trained)."""
    return STUDENT in adapter_names(peft_model)


def student_adapter_name(peft_model: PeftModel) -> str | None:
    """The adapter for the student's forward: ``"student"``, or ``None`` (base weights) for a full student."""
    return STUDENT if is_lora_student(peft_model) else None


def adapter_parameters(peft_model: nn.Module, name: str) -> list[nn.Parameter]:
    """The parameters of adapter ``name`` (LoRA A/B, embedding A/B, DoRA magnitudes), in module order.

    Found by walking the peft tuner layers and their ``adapter_layer_names`` dicts, so the order is the
    same for two adapters of the same config (used to pair the student with its EMA).

    Raises:
        KeyError: no layer holds an adapter called ``name``.
    """
    params: list[nn.Parameter] = []
    for layer in tuner_layers(peft_model):
        for layer_name in layer.adapter_layer_names:
            holder = getattr(layer, layer_name, None)
            if isinstance(holder, nn.ModuleDict) and name in holder:
                params.extend(holder[name].parameters())
            elif isinstance(holder, nn.ParameterDict) and name in holder:
                params.append(holder[name])
    if not params:
        raise KeyError(f"the backbone has no adapter {name!r}; it has {list(getattr(peft_model, 'peft_config', {}))}")
    return params


def base_parameters(peft_model: nn.Module) -> list[nn.Parameter]:
    """Every backbone parameter that belongs to no adapter (the base weights theta), deduplicated."""
    adapter_ids: set[int] = set()
    for layer in tuner_layers(peft_model):
        for layer_name in layer.adapter_layer_names:
            holder = getattr(layer, layer_name, None)
            if isinstance(holder, (nn.ModuleDict, nn.ParameterDict)):
                adapter_ids.update(id(p) for p in holder.parameters())
    return [p for p in peft_model.parameters() if id(p) not in adapter_ids]


def student_parameters(peft_model: PeftModel) -> list[nn.Parameter]:
    """The student's trainable weights: the ``"student"`` LoRA, or all base weights for a full student.

    For a full student the list holds every base weight, whatever its flag; filter on ``requires_grad``
    if some were frozen on purpose.
    """
    return adapter_parameters(peft_model, STUDENT) if is_lora_student(peft_model) else base_parameters(peft_model)


def composer_lora_parameters(peft_model: PeftModel, name: str = COMPOSER) -> list[nn.Parameter]:
    """The composer's encoder LoRA psi (adapter ``name``, default ``"composer"``)."""
    return adapter_parameters(peft_model, name)


@contextmanager
def frozen(params: list[nn.Parameter] | Iterator[nn.Parameter]) -> Iterator[None]:
    """Turn ``requires_grad`` off on ``params`` for the duration of the context, then restore each flag.

    A forward pass run inside records those parameters as constants: the ``backward()`` that follows,
    even after the context has closed, gives them no gradient.
    """
    saved = [(p, p.requires_grad) for p in params]
    try:
        for p, _ in saved:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in saved:
            p.requires_grad_(flag)


def _current_state(peft_model: PeftModel, layers: list[BaseTunerLayer] | None = None) -> tuple[list[str], bool]:
    """The active adapters and whether every adapter layer is disabled (``layers``: the model's
    :func:`tuner_layers`, listed by the caller that already has them)."""
    layers = tuner_layers(peft_model) if layers is None else layers
    disabled = bool(layers) and all(layer.disable_adapters for layer in layers)
    active = list(layers[0].active_adapters) if layers else [peft_model.active_adapter]
    return active, disabled


def _switch(peft_model: PeftModel, active: list[str] | str | None, layers: list[BaseTunerLayer]) -> None:
    """Activate ``active`` (None: all adapters disabled); ``layers`` are the model's :func:`tuner_layers`
    (switching adds or removes none). Flips requires_grad flags (peft does): restore after."""
    if active is None:
        peft_model.base_model.disable_adapter_layers()
        return
    names = [active] if isinstance(active, str) else list(active)
    if len(names) == 1:
        peft_model.set_adapter(names[0])
    else:  # a multi-adapter state set by someone else: restore it as it was
        peft_model.base_model.set_adapter(names)
    if layers and all(layer.disable_adapters for layer in layers):
        peft_model.base_model.enable_adapter_layers()


@contextmanager
def use_adapter(peft_model: nn.Module, name: str | None, *, grads: GradMode = "keep") -> Iterator[nn.Module]:
    """Run the forward passes of the context under exactly one adapter (``None``: the base weights).

    Args:
        peft_model: the shared backbone from :func:`prepare_backbone` (a plain model when it has no
            adapter: then only ``name=None`` is valid and only ``grads`` acts).
        name: the adapter to activate, or ``None`` to disable all adapters.
        grads: which parameters the passes inside may record for the backward (see the module docstring):
            ``"keep"`` the current flags; ``"adapter"`` only the active adapter's parameters (with their
            current flags; all other backbone parameters off); ``"none"`` no backbone parameter.

    Yields:
        ``peft_model``.

    Every ``requires_grad`` flag is the same after the context as before it (peft's switching flips them;
    they are put back right after each switch); a flag changed inside the context is reset on exit. The
    previously active adapter (or the disabled state) is restored on exit, also on exceptions.

    Raises:
        ValueError: ``name`` is not an adapter of the backbone or ``grads`` is unknown.
    """
    if name is not None and name not in adapter_names(peft_model):
        raise ValueError(f"unknown adapter {name!r}; the backbone has {adapter_names(peft_model)}")
    if grads not in ("keep", "adapter", "none"):
        raise ValueError(f"grads must be 'keep', 'adapter' or 'none', got {grads!r}")
    if not isinstance(peft_model, PeftModel):  # no adapter at all: only the gradient mode applies
        with frozen([p for p in peft_model.parameters() if p.requires_grad] if grads != "keep" else []):
            yield peft_model
        return
    params = list(peft_model.parameters())
    flags = [p.requires_grad for p in params]
    layers = tuner_layers(peft_model)  # for the switch in (switching adds or removes none)
    prev_active, prev_disabled = _current_state(peft_model, layers)
    prev_peft_active = peft_model.active_adapter

    def restore_flags() -> None:
        for p, flag in zip(params, flags, strict=True):
            if p.requires_grad != flag:
                p.requires_grad_(flag)

    try:
        _switch(peft_model, name, layers)
        restore_flags()
        if grads != "keep":
            keep = {id(p) for p in adapter_parameters(peft_model, name)} if (grads == "adapter" and name) else set()
            for p in params:
                if id(p) not in keep and p.requires_grad:
                    p.requires_grad_(False)
        yield peft_model
    finally:
        layers = tuner_layers(peft_model)  # listed again: the context may have added an adapter
        _switch(peft_model, prev_active, layers)
        if prev_disabled:
            _switch(peft_model, None, layers)
        peft_model.active_adapter = prev_peft_active
        restore_flags()


def parameter_storage(module: nn.Module) -> set[int]:
    """The set of ``data_ptr()`` of every parameter (test helper: two modules share weights when these meet)."""
    return {p.data_ptr() for p in module.parameters()}


def copy_adapter(peft_model: PeftModel, source: str, target: str) -> list[nn.Parameter]:
    """Add (or overwrite) adapter ``target`` with ``source``'s config and current weights, frozen.

    Used for the warm-started composer's snapshot c_phi0 (LOPD's latent anchor): a second set of LoRA
    weights on the same backbone, not a copy of the backbone. The active adapter and every other
    parameter's ``requires_grad`` flag are left as they were.

    Returns:
        The target adapter's parameters (``requires_grad`` False), paired in order with ``source``'s.

    Raises:
        ValueError: ``source`` is not an adapter of the backbone.
    """
    if source not in peft_model.peft_config:
        raise ValueError(f"unknown adapter {source!r}; the backbone has {adapter_names(peft_model)}")
    if target not in peft_model.peft_config:
        params = list(peft_model.parameters())
        flags = [p.requires_grad for p in params]
        prev_active, prev_disabled = _current_state(peft_model)
        peft_model.add_adapter(target, peft_model.peft_config[source])
        layers = tuner_layers(peft_model)  # after the adapter was added: it may have injected layers
        _switch(peft_model, prev_active, layers)
        if prev_disabled:
            _switch(peft_model, None, layers)
        for p, flag in zip(params, flags, strict=True):
            p.requires_grad_(flag)
    pairs = list(zip(adapter_parameters(peft_model, target), adapter_parameters(peft_model, source), strict=True))
    for dst, src in pairs:
        dst.requires_grad_(False)
        dst.data.copy_(src.detach())
    return [dst for dst, _ in pairs]


def merged_student(peft_model: PeftModel) -> nn.Module:
    """A standalone copy of the student: the base weights with the student LoRA merged, no other adapter.

    The shared backbone is left untouched (the copy is made first). Ready for ``save_pretrained``. The copy
    computes what the student computes, in exact arithmetic:

    * dtype: a LoRA student whose base weights are bfloat16 or float16 is merged and returned in float32
      (``W + scale B A`` on a 16-bit grid would round away an update below the grid's resolution, about half of
      a small one); the copy then takes twice the memory of the 16-bit base. A full-parameter student, or a
      float32 one, keeps its dtype.
    * tied weights: a LoRA on ``embed_tokens`` or ``lm_head`` of a model with tied word embeddings is merged
      into an untied copy (:func:`lopd_lightning.tied_weights.untie_lora_weights`): separate embeddings and
      head, ``config.tie_word_embeddings`` False.

    Raises:
        ValueError: a student LoRA on a weight tied other than as the word embeddings
            (:func:`~lopd_lightning.tied_weights.check_tied_lora`; refused when the backbone is built).
    """
    import copy

    import torch

    clone = copy.deepcopy(peft_model)
    if not isinstance(clone, PeftModel):  # a full student without adapters is the model itself
        return clone
    for name in adapter_names(clone):
        if name != STUDENT:
            clone.delete_adapter(name)
    if not is_lora_student(clone):
        return clone.unload()
    clone.set_adapter(STUDENT)
    untie_lora_weights(clone, STUDENT)
    if any(p.is_floating_point() and p.dtype.itemsize < 4 for p in clone.parameters()):
        clone.to(torch.float32)  # exact for the 16-bit base weights; the merge below then rounds nothing away
    return clone.merge_and_unload()
