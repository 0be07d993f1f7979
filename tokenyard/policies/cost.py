"""Money: exact conversion between decimal prices in YAML and integer micro-units, and the one
rounding rule every cost in Tokenyard uses.

Money is never a float. A policy writes prices and budgets in currency units as decimals
("0.05" or 0.05 per million tokens); they are read from the YAML *source text* (not from a
float the YAML library made) and converted exactly with decimal.Decimal into integer
micro-units (1 unit = 1_000_000 micro-units). A value with finer precision than one micro-unit
is refused, never rounded.

Rounding rule (the same as tokenyard/gateway/config/deployment.py Prices.cost, so the ledger, the simulation and
the bill agree): the exact cost of a request is
    ((prompt - cached) * input + cached * cached_input + completion * output) / 1_000_000
micro-units, an exact rational; it is rounded ONCE, per request, half up (x.5 goes up), with
integer arithmetic. Sums of costs are sums of these integers, so a rollup equals the sum of its
records exactly.
"""
from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal, InvalidOperation, localcontext
from typing import Protocol

MICROS_PER_UNIT = 1_000_000
TOKENS_PER_PRICE = 1_000_000     # prices are per million tokens
MAX_MONEY_MICROS = 10**18        # a bound far above any real price or budget; keeps typos out


def parse_money(text: str) -> int:
    """Decimal currency text ("0.05", "12", "1.5e-3") -> integer micro-units, exactly.

    Raises ValueError with a short reason for anything that is not a finite, non-negative
    decimal with at most six places after the point.
    """
    raw = text.strip()
    try:
        value = Decimal(raw)
    except InvalidOperation:
        raise ValueError(f"must be a decimal amount of currency, e.g. 0.05 (got {text!r})") from None
    if not value.is_finite():
        raise ValueError(f"must be a finite amount (got {text!r})")
    if value < 0:
        raise ValueError(f"must be >= 0 (got {text!r})")
    with localcontext() as ctx:
        ctx.prec = 80        # enough digits that the multiplication below is exact
        micros = value * MICROS_PER_UNIT
        if micros != micros.to_integral_value():
            raise ValueError(f"has precision finer than one micro-unit (0.000001): {text!r}")
    if micros > MAX_MONEY_MICROS:
        raise ValueError(f"is implausibly large (got {text!r})")
    return int(micros)


def format_money(micros: int) -> str:
    """Integer micro-units -> the shortest exact decimal text ("0.05", "12", "0.000001")."""
    if not isinstance(micros, int) or isinstance(micros, bool):
        raise TypeError(f"money must be an int of micro-units, got {type(micros).__name__}")
    sign = "-" if micros < 0 else ""
    whole, frac = divmod(abs(micros), MICROS_PER_UNIT)
    if frac == 0:
        return f"{sign}{whole}"
    return f"{sign}{whole}.{frac:06d}".rstrip("0")


class PriceTable(Protocol):
    """What the cost rule reads of a price (schema.Prices is the one implementation). Read-only
    properties, so a frozen dataclass meets the protocol."""

    @property
    def input(self) -> int: ...
    @property
    def cached_input(self) -> int: ...
    @property
    def output(self) -> int: ...


def round_half_up(numerator: int, denominator: int) -> int:
    """numerator / denominator rounded half up, for numerator >= 0 and denominator > 0."""
    return (2 * numerator + denominator) // (2 * denominator)


def estimate_cost(prices: Mapping[str, PriceTable], engine: str, prompt_tokens: int, cached_tokens: int,
                  completion_tokens: int, percent: int = 100) -> int:
    """Cost in integer micro-units of one request on `engine`, by the rule in the module doc.

    cached_tokens are part of prompt_tokens (billed at cached_input instead of input); percent:
    the share of the prices charged (a Batch API line's batch price), inside the one rounding.
    """
    for name, n in (("prompt_tokens", prompt_tokens), ("cached_tokens", cached_tokens),
                    ("completion_tokens", completion_tokens)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{name} must be an int >= 0, got {n!r}")
    if cached_tokens > prompt_tokens:
        raise ValueError(f"cached_tokens ({cached_tokens}) exceeds prompt_tokens ({prompt_tokens})")
    try:
        p = prices[engine]
    except KeyError:
        raise KeyError(f"no prices for engine {engine!r}; priced: {', '.join(sorted(prices))}") from None
    return request_cost(p, prompt_tokens, cached_tokens, completion_tokens, percent)


def request_cost(p: PriceTable, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
                 percent: int = 100) -> int:
    """The cost rule: the exact total over a million tokens, rounded half up once, per request.
    Every bill (the spend ledger's records, budgets, what-if simulation) goes through here.

    percent scales the prices (the Batch API's discounted price, e.g. 50) inside the one rounding,
    so a discounted bill is not the rounding of an already rounded cost."""
    if not isinstance(percent, int) or isinstance(percent, bool) or not 0 <= percent <= 100:
        raise ValueError(f"percent must be an int in [0, 100], got {percent!r}")
    exact = ((prompt_tokens - cached_tokens) * p.input + cached_tokens * p.cached_input
             + completion_tokens * p.output)
    return round_half_up(exact * percent, TOKENS_PER_PRICE * 100)
