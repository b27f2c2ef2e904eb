"""Strategy: the one-method interface every decoding strategy implements.

A strategy is a proposer. `propose(state)` drafts however it likes and returns a `Proposal`: the
token tree the target verifies and, for a draft model, which draft KV row belongs to each node. It
is a coroutine of model calls (runner.py): every draft forward is `yield from`, so the scheduler
can batch the calls of many requests. The shared step (step.py) then verifies, commits the target
and draft caches, and reports; no strategy verifies or commits. Candidates are scored with the
request's `state.values` and sizing goes to its budget, one `state.budget.plan(Round(...))` per round
of drafting, never inside an inner loop (fixed or auto, always present; budget/): nodes found later
in the round pass its answer's bars (`Plan.joins`). A strategy object holds options only; per-request state
lives in the DecodeState it is given.

Options are the `__init__` parameters, typed and bounded with `trtspec.options` aliases; every
construction (from a config or from Python) is checked, and a bad option is one ConfigError line
naming `strategies.NAME.KEY`.
"""
from __future__ import annotations

from ...errors import ConfigError
from ...options import checked_init
from ..decode import DecodeState
from ..draft_model import DraftModel
from ..drafters import DRAFTERS, Drafter, make_drafter
from ..effects import Calls
from ..proposal import Proposal


class Strategy:
    name = "base"
    needs_draft = False
    auto = False       # budget: auto (the request's budget sizes every tree, up to `nodes`)
    nodes = 0          # the most nodes a tree adds to its root (the cap, with auto)
    drafters: tuple[Drafter, ...] | list[Drafter] = ()   # the drafters it grows trees with, in order
    model: DraftModel | None = None     # the draft model, where it runs one (`needs_draft`; draft_model.py)

    def __init__(self) -> None:
        pass

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__init__")
        if own is None and cls.__init__ is not Strategy.__init__:
            return                                # inherits a parent strategy's checked options
        if own is None:                           # no options: still refuse unknown keys
            def own(self) -> None:
                pass
        cls.__init__ = checked_init(f"strategies.{cls.name}")(own)

    def propose(self, st: DecodeState) -> Calls:
        """The tree this step verifies (a coroutine of draft calls); returns a Proposal."""
        raise NotImplementedError

    def free(self, st: DecodeState) -> Proposal:
        """The tree of a step the budget's ar gate keeps from drafting (no draft forward pays in this
        batch): what costs no model call. The root alone, a plain ar step, unless the strategy has a
        free drafter (suffix tries)."""
        return Proposal.root(st.root)

    @staticmethod
    def root_only(st: DecodeState) -> Calls:
        """The root alone (a coroutine that makes no model call)."""
        return Proposal.root(st.root)
        yield                                       # noqa: unreachable: makes this a coroutine

    def prepare(self, st: DecodeState) -> Calls:
        """Before each step's proposal: what its drafters need from a model role (Drafter.prepare)."""
        for d in self.drafters:
            yield from d.prepare(st)

    @property
    def reads_heads(self) -> set[str]:
        """The kinds of head role its drafters ask (the folder must have them: `heads:`)."""
        return {d.reads_head for d in self.drafters if d.reads_head}

    @property
    def reads_hidden(self) -> bool:
        """Whether a drafter of it reads the target's hidden rows (the target must return them)."""
        return any(d.reads_hidden for d in self.drafters)

    def drafter_choice(self, drafter: str | list[str], suffix: bool) -> list[str]:
        """The names of the drafters a strategy grows its trees with (drafters/), in the order it asks
        them: `drafter` (a name, a list, or names joined by "+": `suffix+ngram`, as a comma-separated
        list of strategy specs can hold them), or with `suffix: true` the suffix tries (its older
        spelling); both naming others, or a name given twice, is a ConfigError."""
        names = drafter.split("+") if isinstance(drafter, str) else list(drafter)
        if suffix and names not in (["ngram"], ["suffix"]):
            raise ConfigError(f"strategies.{self.name}: suffix: true is drafter: suffix, and drafter is {drafter!r}: "
                              "give one")
        if len(set(names)) < len(names):
            raise ConfigError(f"strategies.{self.name}.drafter = {drafter!r}: a drafter is named twice; name each once")
        return ["suffix"] if suffix else names

    def cheap_drafters(self, names: list[str], only: dict[str, dict] | None = None, **options) -> list[Drafter]:
        """The drafters `names`, each with `options` (and `only[name]`, options for that one alone),
        through the registry (an unknown name: a ConfigError naming `strategies.NAME.drafter` and the
        choices): the strategy's `drafters`, which `prepare` and `finished` reach. The draft model is
        no drafter: a strategy that runs it holds it as `model` (draft_model.py)."""
        where = f"strategies.{self.name}.drafter"
        if "draft" in names:
            raise ConfigError(f"{where} = 'draft': the draft model is not a drafter (a strategy that runs it holds "
                              f"it already); name drafters: {', '.join(DRAFTERS)}")
        self.drafters = [make_drafter(n, where, **options, **(only or {}).get(n, {})) for n in names]
        return self.drafters

    def sized(self, budget: int | str, cap: int) -> None:
        """A tree budget option: a fixed number of nodes, or "auto" up to `cap`."""
        self.auto = budget == "auto"
        self.nodes = cap if self.auto else budget

    def max_tree_size(self) -> int:
        """Largest tree one step can send to the target, root included."""
        return self.nodes + 1

    def auto_nodes(self) -> int | None:
        """With budget auto: the most nodes the budget may add to a tree (its cap); None: fixed."""
        return self.nodes if self.auto else None

    def finished(self, st: DecodeState, prompt: list[int], output: list[int]) -> None:
        """A request of this strategy ended normally (stop or length): what its drafters may learn from it."""
        for d in self.drafters:
            d.finished(st, prompt, output)

    def max_draft_rows(self) -> int:
        """Most draft-KV rows one step writes beyond the sequence (fed tree nodes, reviewed chains)."""
        return 0

    def max_rows(self) -> int:
        """KV rows a step may need beyond the current sequence, in the target or the draft cache."""
        return max(self.max_tree_size(), self.max_draft_rows())
