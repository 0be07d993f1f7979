"""Which engine serves a request: a pinned engine name, or the interim rule for model "auto".

Interim rule (when no learned router is configured), decided on the prompt's token count:
  - `routing.small` and `routing.large` both set: prompts of at most `long_prompt_tokens`
    tokens go to small (reason "auto:short_prompt"), longer ones to large ("auto:long_prompt");
  - otherwise "auto" goes to the first engine in the file (reason "auto:default").
A request naming an engine gets it (reason "pinned"); so does `ENGINE:ADAPTER`, an engine's LoRA
adapter (its `lora_modules`, those the admin API loaded, and those the engine reports in its stats: a
replica another gateway loaded one on), with the adapter carried in the route; any other name is a 404.

The count is taken with the small engine's tokenizer; engines whose tokenizer files are
identical share one tokenizer object, so the ids are reused and the prompt is tokenised once.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokenyard.gateway.edge.errors import NotFound

AUTO = "auto"


@dataclass(slots=True)
class Routing:
    """The interim rule for model "auto" when no learned router is configured: short prompts to `small`."""

    small: str | None = None
    large: str | None = None
    long_prompt_tokens: int = 256          # prompts with more tokens than this go to `large`


@dataclass(slots=True, frozen=True)
class Route:
    engine: str
    reason: str
    lora: str | None = None     # the engine's LoRA adapter the request named (`ENGINE:ADAPTER`)


class Router:
    def __init__(self, engine_names: list[str], rule: Routing, adapters: dict[str, list[str]] | None = None) -> None:
        if not engine_names:
            raise ValueError("a router needs at least one engine")
        self.engines = list(engine_names)
        self.rule = rule
        self._split = rule.small is not None and rule.large is not None
        # engine -> the names of its LoRA adapters, addressed as ENGINE:ADAPTER
        self.adapters = {e: list(names) for e, names in (adapters or {}).items() if names}
        # engine -> the adapters its backend reports now (set by the gateway once engines attach)
        self.live: Callable[[str], list[str]] | None = None

    def adapters_of(self, engine: str) -> list[str]:
        """The adapters of one engine a request may name: this gateway's record and the engine's report."""
        names = set(self.adapters.get(engine, ()))
        if self.live is not None:
            names.update(self.live(engine))
        return sorted(names)

    def adapter_models(self) -> list[tuple[str, str]]:
        """(engine, adapter) for every adapter a request may name, in deployment order."""
        engines = list(dict.fromkeys([*self.engines, *self.adapters]))
        return [(e, a) for e in engines for a in self.adapters_of(e)]

    def add_adapter(self, engine: str, adapter: str) -> None:
        """An adapter loaded at run time (the admin API) becomes a model: ENGINE:ADAPTER."""
        names = self.adapters.setdefault(engine, [])
        if adapter not in names:
            names.append(adapter)

    def remove_adapter(self, engine: str, adapter: str) -> None:
        names = self.adapters.get(engine, [])
        if adapter in names:
            names.remove(adapter)
        if not names:
            self.adapters.pop(engine, None)

    def pinned(self, model: str) -> Route | None:
        """The route for an engine name; None for "auto"; NotFound for anything else."""
        if model == AUTO:
            return None
        if model in self.engines:
            return Route(model, "pinned")
        engine, sep, adapter = model.partition(":")
        if sep and (adapter in self.adapters.get(engine, ()) or
                    (self.live is not None and adapter in self.live(engine))):
            return Route(engine, "pinned", adapter)
        names = [*self.engines, *(f"{e}:{a}" for e, a in self.adapter_models())]
        raise NotFound(f"The model '{model}' does not exist; available: auto, {', '.join(names)}",
                       param="model", code="model_not_found")

    @property
    def counting_engine(self) -> str:
        """Whose tokenizer measures the prompt for the auto rule."""
        return self.rule.small if self._split else self.engines[0]

    def auto(self, prompt_tokens: int) -> Route:
        if not self._split:
            return Route(self.engines[0], "auto:default")
        if prompt_tokens <= self.rule.long_prompt_tokens:
            return Route(self.rule.small, "auto:short_prompt")
        return Route(self.rule.large, "auto:long_prompt")
