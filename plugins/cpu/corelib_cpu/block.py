"""The value the cpu backend's stages pass along one block of rows, and its probability cuts.

The core template hands each stage the previous stage's result. On this backend that is a
:class:`Block`: the block's dense logits (the caller's rows until a stage writes, then a copy
in the per-thread workspace) plus, once step 12 ran, a candidate set for the rows with a top-k
(:class:`Candidates`), and the pending probability cuts of min-p and top-p (:class:`Cut`).
Every stage (``logit_stages``, ``filter_stages``, ``draw_stage``, ``verification``,
``logprob_stage``) and verification's judges (``judge``) read and update it in place through
the methods here: a cut is applied to the logits (:meth:`Block.apply_cuts`), or a row written
out in full (:meth:`Block.densify`), only when a stage reads that row whole.

Masks use thresholds and copysign/min, never boolean fills (which run ~10-40x slower than
arithmetic on CPUs). Shapes: ``n`` rows of a block, ``V`` vocabulary, ``W`` candidates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from corelib.sampler import NEG_INF

from . import kernels
from .draw import exp_weights
from .plan import BlockPlan
from .rowops import GROUP, group_maxima
from .select import nucleus_threshold
from .state import BlockState
from .workspace import Workspace

_INF = torch.tensor(float("inf"))
#: Blocks of up to this many rows keep their group maxima in a workspace pair (``maxima``).
FEW_ROWS = 2


@dataclass(slots=True)
class Candidates:
    """Rows of a block whose kept set is a few candidate tokens (rows with top-k)."""

    rows: list             # block-local rows, ascending
    index: torch.Tensor    # int64 [nc], the same rows
    values: torch.Tensor   # float32 [nc, W], descending before top-p; -inf = dropped
    ids: torch.Tensor      # int64 [nc, W]
    views: Optional[tuple] = None   # (values, ids, their numpy views) as a kernel wrote them
    typical: bool = False  # step 13a has kept its set in values (``FilterStages.candidate_chain``)

    def arrays(self) -> Optional[tuple]:
        """(values, ids) as numpy views when ``views`` still holds the tensors now in
        values and ids (a stage that replaces them leaves the kernels to convert), else None."""
        views = self.views
        if views is None or views[0] is not self.values or views[1] is not self.ids:
            return None
        return views[2], views[3]


@dataclass
class Cut:
    """Whole rows filtered by a probability threshold (min-p, top-p): token t of row
    ``rows[j]`` is kept when its probability is >= ``cut[j]`` (a NaN cut keeps none).
    ``weights`` float32 [m, V]: once the cut is known, the kept probabilities, 0 elsewhere
    (the draw's weights, and where a positive cut leaves the mask).

    A top-p cut starts pending (``cut[j]`` None, ``weights`` the row's probabilities,
    ``top_p[j]`` its parameter): the draw tries tokens of the whole distribution and keeps
    one when it is in the nucleus (:func:`~corelib_cpu.select.nucleus_contains`), and the
    threshold is found (:meth:`resolve`) only when that fails or the whole kept
    set is read."""

    rows: list
    weights: torch.Tensor
    cut: list
    top_p: Optional[list] = None

    def pending(self, at: list) -> list:
        """The places among ``at`` whose cut is not known yet."""
        return [j for j in at if self.cut[j] is None]

    def threshold_rows(self, at: list, cuts: list) -> None:
        """Set the cuts of places ``at`` and zero their weights below them, one threshold
        pass per row (``p > the float32 just below the cut`` keeps exactly ``p >= cut``; a
        NaN cut keeps nothing)."""
        below = torch.nextafter(torch.tensor(cuts), torch.tensor(NEG_INF)).tolist()
        for j, cut, value in zip(at, cuts, below):
            torch.threshold_(self.weights[j], value, 0.0)
            self.cut[j] = cut

    def resolve(self, at: list, workspace: Workspace) -> None:
        """Find the pending top-p cuts of places ``at``: the nucleus threshold by histogram
        select over the rows' probabilities (``select.nucleus_threshold``)."""
        at = self.pending(at)
        if not at:
            return
        index = torch.tensor(at, dtype=torch.long)
        whole = at == list(range(len(self.rows)))        # every place, in the record's order
        probs = self.weights if whole else self.weights.index_select(0, index)
        top_p = torch.tensor([self.top_p[j] for j in at], dtype=torch.float32)
        threshold = nucleus_threshold(probs, top_p, workspace)
        # a row with a NaN (float32 overflow upstream) is NaN throughout: it keeps nothing
        threshold = torch.where(torch.isnan(probs[:, 0]), float("nan"), threshold)
        self.threshold_rows(at, threshold.tolist())


@dataclass
class SourceRows:
    """A block's logits not gathered yet: its row r is ``source[rows[r]]`` (the caller's
    float32 rows, per-request logits or verify's flat slots), until a stage reads ``Block.x``
    and they are gathered into ``buffer`` (float32 [n, V], the workspace's)."""

    source: torch.Tensor
    rows: torch.Tensor
    buffer: torch.Tensor

    def gather(self) -> torch.Tensor:
        return torch.index_select(self.source, 0, self.rows, out=self.buffer)

    def maxima(self) -> torch.Tensor:
        """The block's group maxima, from the source rows it reads (each once, however many
        block rows read it), never gathering the rows themselves."""
        low, high = (int(v) for v in torch.aminmax(self.rows))
        return group_maxima(self.source[low:high + 1]).index_select(0, self.rows - low)


@dataclass(slots=True)
class Block:
    """What the template passes between the stages of one block: its logits and what the
    filters have decided so far (see the module docstring). Slotted: a step makes one per
    block, and a cold step pays for each dictionary it fills."""

    state: BlockState
    _x: Optional[torch.Tensor]           # see x
    owned: bool                          # x is ours to write (else the caller's rows)
    workspace: Workspace                 # the sampler's buffers of this thread (copies, cuts)
    cand: Optional[Candidates] = None
    cuts: dict = field(default_factory=dict)     # block row -> (its latest Cut, place in it)
    masked: set = field(default_factory=set)     # rows whose cut is applied to x
    top: Optional[torch.Tensor] = None           # float32 [n, 1]: x's row maxima, or None
    finite_pending: bool = False                 # the NaN/+inf check waits for step 5's maxima
    finite: Optional[torch.Tensor] = None        # bool [n]: that check's result, written by
                                                 # any_token_left (steps with a thinking budget)
    row_max: Optional[torch.Tensor] = None       # float32 [n]: maxima after steps 3-5
    all_valid: bool = False                      # any_token_left saw every row finite with
                                                 # a token left (neutralise_rows then skips)
    drawn_finite: Optional[torch.Tensor] = None  # bool [n]: step 14's token has a finite logit
    weights: list = field(default_factory=list)  # (whole rows, float32 [m, V] their draw
                                                 # weights: the final distribution, unnormalised)
    dropped: bool = False                        # a stage dropped tokens in bulk (-inf)
    unread: Optional[SourceRows] = None          # x's rows while not gathered (_x None)
    source: Optional[torch.Tensor] = None        # float32 [n, V]: log-probabilities after the
                                                 # filter group (``sample_selected``), which
                                                 # the selectors read
    _maxima: Optional[torch.Tensor] = None
    _maxima_array: object = None                 # numpy view of _maxima (a workspace pair's)
    top_pair: Optional[tuple] = None             # (tensor, numpy array): a workspace pair that
                                                 # holds the row maxima while it is ``top``

    @property
    def x(self) -> torch.Tensor:
        """float32 [n, V]: the logits after the stages so far; candidate rows: see cand; rows
        with a cut: masked when read, see cuts; undivided when the block divides candidates
        only (plan.candidates_only). Gathered on first read when ``unread`` holds them
        (``maxima`` and ``argmax`` read them where they are)."""
        if self._x is None:
            self._x, self.unread = self.unread.gather(), None
        return self._x

    @x.setter
    def x(self, value: torch.Tensor) -> None:
        self._x, self.unread = value, None

    @property
    def plan(self) -> BlockPlan:
        return self.state.plan

    @property
    def candidate_rows(self) -> set:
        return set(self.cand.rows) if self.cand is not None else set()

    def maxima(self) -> torch.Tensor:
        """x's group maxima (``rowops.group_maxima``), computed once until x changes."""
        if self._maxima is None:
            if self.unread is not None:
                self._maxima = self.unread.maxima()
                return self._maxima
            x = self.x
            n, V = x.shape
            if n <= FEW_ROWS and V % GROUP == 0:
                # a few rows: into a buffer whose numpy view the kernels take, made once (the
                # allocation and the conversion are several operator calls per step)
                self._maxima, self._maxima_array = self.workspace.pair("maxima", (n, V // GROUP))
                group_maxima(x, out=self._maxima)
            else:
                self._maxima = group_maxima(x)
        return self._maxima

    def maxima_and_row_maxima(self, top) -> Optional[bool]:
        """:meth:`maxima` and each row's maximum (into ``top``, float32 numpy ``[n]``) in one
        compiled pass over x (``kernels.group_and_row_maxima``), for a few rows whose maxima
        are not known yet: whether every row's maximum is finite and nonzero (False: the
        maxima are not kept; torch computes them where a stage reads them); None where that
        pass does not run."""
        if self._maxima is not None or self.unread is not None:
            return None
        n, V = self.x.shape
        if n > FEW_ROWS or V % GROUP:
            return None
        pair = self.workspace.pair("maxima", (n, V // GROUP))
        valid = kernels.group_and_row_maxima(self.x, GROUP, pair[1], top)
        if valid:
            self._maxima, self._maxima_array = pair
        return valid

    def maxima_array(self):
        """The numpy view of :meth:`maxima` when it lives in a workspace pair, else None."""
        return self._maxima_array if self._maxima is not None else None

    def changed(self) -> None:
        """x was written: forget what was derived from it."""
        self._maxima = None
        self._maxima_array = None
        self.top = None

    def force(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Step 8b on x (ours to write): each of ``rows`` (int64 [m]) keeps only its token of
        ``tokens`` (int64 [m]), with logit 0; every other token -inf. The group maxima and row
        maxima known so far are updated, not dropped: the other rows keep theirs."""
        maxima, top = self._maxima, self.top
        self.x.index_fill_(0, rows, NEG_INF)
        self.x[rows, tokens] = 0.0
        self.changed()
        if maxima is not None:
            maxima.index_fill_(0, rows, NEG_INF)
            maxima[rows, tokens // GROUP] = 0.0
            self._maxima = maxima
        if top is not None:
            self.top = top.index_fill(0, rows, 0.0)
        self.dropped = True

    def own(self) -> torch.Tensor:
        """x as the block's own copy (in the workspace), ready to be written in place."""
        if not self.owned:
            self.x = self.workspace.take("x", tuple(self.x.shape)).copy_(self.x)
            self.owned = True
        return self.x

    def set_cut(self, rows: list, probs: torch.Tensor, cut: torch.Tensor) -> None:
        """Record a cut (see :class:`Cut`) of the given rows: probs float32 [m, V] become the
        kept probabilities in place (see :meth:`Cut.threshold_rows`)."""
        record = Cut(rows, probs, [None] * len(rows))
        record.threshold_rows(list(range(len(rows))), cut[:, 0].tolist())
        self.attach(record)

    def attach(self, record: Cut) -> None:
        """Make ``record`` the latest cut of its rows (not applied to x yet)."""
        for j, row in enumerate(record.rows):
            self.cuts[row] = (record, j)
            self.masked.discard(row)

    def apply_cuts(self, rows: list) -> None:
        """Mask x where the cut of the given rows drops tokens (-inf), for stages that read
        x itself. A positive cut keeps exactly the tokens with positive weight; a cut of 0
        keeps every token; a NaN cut none."""
        if not self.cuts:
            return
        pending = [row for row in rows if row in self.cuts and row not in self.masked]
        if not pending:
            return
        x = self.own()
        places = {}                           # each record's pending places, resolved together
        for row in pending:
            record, j = self.cuts[row]
            places.setdefault(id(record), (record, []))[1].append(j)
        for record, at in places.values():
            record.resolve(at, self.workspace)
        masking = []                          # (row, record, place) of the cuts that drop tokens
        for row in pending:
            record, j = self.cuts[row]
            if record.cut[j] != 0.0:
                masking.append((row, record, j))
        for (r0, r1), (record, j0) in _aligned_runs(masking):
            # sign(w) - 0.5 is -0.5 where w == 0 and 0.5 where w > 0; copysign makes that
            # -inf / +inf and min() masks. (No subtraction of a tiny value: subnormal results
            # cost a microcode assist each on x86, ~100x an ordinary one.) One run of rows
            # whose cut places are consecutive too is masked in four operator calls.
            weights = record.weights[j0:j0 + r1 - r0]
            sign = torch.sign(weights, out=self.workspace.take("sign", tuple(weights.shape)))
            torch.minimum(x[r0:r1], torch.copysign(_INF, sign.sub_(0.5), out=sign), out=x[r0:r1])
        self.masked.update(pending)
        self.changed()

    def densify(self, rows: list) -> None:
        """Make the given rows whole rows of x holding their final logits so far (their cuts
        applied, their candidates written out and dropped from the candidate set), for a
        stage that reads them in full."""
        self.apply_cuts(rows)
        cand = self.cand
        if cand is None:
            return
        wanted = set(rows)
        inside = [j for j, row in enumerate(cand.rows) if row in wanted]
        if not inside:
            return
        x = self.own()
        if len(inside) == len(cand.rows):
            at, rest = None, []
        else:
            at = torch.tensor(inside, dtype=torch.long)
            rest = [j for j in range(len(cand.rows)) if j not in set(inside)]
        ids = cand.ids if at is None else cand.ids[at]
        values = cand.values if at is None else cand.values[at]
        index = cand.index if at is None else cand.index[at]
        full = torch.full((len(inside), x.shape[1]), NEG_INF)
        full.scatter_(1, ids, values)
        x.index_copy_(0, index, full)
        if rest:
            keep = torch.tensor(rest, dtype=torch.long)
            self.cand = Candidates([cand.rows[j] for j in rest], cand.index[keep], cand.values[keep],
                                   cand.ids[keep], typical=cand.typical)
        else:
            self.cand = None
        self.changed()

    def replace_rows(self, rows: list, values: torch.Tensor) -> None:
        """Make the given rows (ascending) whole rows of x holding ``values`` (float32 [m, V],
        their final logits so far, -inf for dropped tokens): their cuts and candidates are
        forgotten, not applied."""
        x = self.own()
        x.index_copy_(0, self.plan.index(rows), values)
        for row in rows:
            self.cuts.pop(row, None)
            self.masked.discard(row)
        cand = self.cand
        if cand is not None:
            gone = set(rows)
            rest = [j for j, row in enumerate(cand.rows) if row not in gone]
            if len(rest) < len(cand.rows):
                keep = torch.tensor(rest, dtype=torch.long)
                self.cand = Candidates([cand.rows[j] for j in rest], cand.index[keep], cand.values[keep],
                                       cand.ids[keep], typical=cand.typical) if rest else None
        self.changed()
        self.dropped = True

    def common_cut(self, rows: list):
        """(the Cut every given row belongs to and the rows' places in it), or (None, None)."""
        if not self.cuts:
            return None, None
        cuts = [self.cuts.get(row) for row in rows]
        first = cuts[0]
        if first is None or any(c is None or c[0] is not first[0] for c in cuts):
            return None, None
        return first[0], [j for _, j in cuts]

    def weights_of(self, rows: list, buffer: str = "weights") -> torch.Tensor:
        """float32 [m, V]: the draw weights of whole rows: their cut's kept probabilities
        (cuts resolved first), or exp(x - max) for rows no probability filter touched (into
        the workspace buffer ``buffer``). Recorded in ``weights`` for verification."""
        weights = self.row_weights(rows, buffer)
        self.weights.append((rows, weights))
        return weights

    def row_weights(self, rows: list, buffer: str) -> torch.Tensor:
        """``weights_of`` without the record (for a one-off read of a row's distribution)."""
        record, at = self.common_cut(rows)
        if record is not None:
            record.resolve(at, self.workspace)
            return rows_of(record.weights, at)
        cuts = [self.cuts.get(row) for row in rows] if self.cuts else None
        if cuts is None or all(c is None for c in cuts):
            x = pick_rows(self.x, rows, self.plan)
            top = None if self.top is None else pick_rows(self.top, rows, self.plan)
            return exp_weights(x, self.workspace.take(buffer, tuple(x.shape)), top, self.sparse())
        weights = self.workspace.take(buffer, (len(rows), self.x.shape[1]))
        for j, (row, c) in enumerate(zip(rows, cuts)):
            if c is None:
                exp_weights(self.x[row:row + 1], weights[j:j + 1], sparse=self.sparse())
            else:
                c[0].resolve([c[1]], self.workspace)
                weights[j].copy_(c[0].weights[c[1]])
        return weights

    def sparse(self) -> bool:
        """Whether the block's rows may hold many tokens far below their maxima (see
        ``draw.exp_weights``): a stage dropped tokens in bulk, or a random row's temperature
        is below 1."""
        return self.dropped or bool(self.plan.temperature_below_one)

    def materialize(self) -> torch.Tensor:
        """float32 [n, V]: the block's final logits (cuts applied, candidate rows written out
        in full, -inf for dropped tokens). Reuses x."""
        self.densify(list(self.cuts) + (self.cand.rows if self.cand is not None else []))
        return self.own()


def _aligned_runs(masking: list) -> list:
    """``[((r0, r1), (record, j0)), ...]``: ``masking``'s (row, record, place) triples cut into
    runs of consecutive rows whose places in one record are consecutive too, so that rows
    r0..r1-1 take places j0.. of the record."""
    runs = []
    for row, record, j in masking:
        if runs:
            (r0, r1), (last, j0) = runs[-1]
            if row == r1 and last is record and j == j0 + (r1 - r0):
                runs[-1] = ((r0, r1 + 1), (last, j0))
                continue
        runs.append(((row, row + 1), (record, j)))
    return runs


def runs(rows: list) -> list[tuple[int, int]]:
    """Ascending rows as runs of consecutive ones: [(r0, r1), ...], rows r0..r1-1 each."""
    out = []
    for row in rows:
        if out and out[-1][1] == row:
            out[-1] = (out[-1][0], row + 1)
        else:
            out.append((row, row + 1))
    return out


def take_rows(x: torch.Tensor, rows: list, bp: BlockPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(x's rows as a tensor, their indices int64). All rows: x itself (a view, so in-place
    changes land in x); otherwise a copy (to be written back by the caller)."""
    index = bp.index(rows)
    if len(rows) == x.shape[0]:
        return x, index
    return x.index_select(0, index), index


def rows_of(x: torch.Tensor, at: list) -> torch.Tensor:
    """x[at] for places ``at`` (ascending), without a copy (a view of x) when they are
    consecutive, as a single row always is."""
    first = at[0]
    return x[first:first + len(at)] if at[-1] - first == len(at) - 1 else x[at]


def pick_rows(x: torch.Tensor, rows: list, bp: BlockPlan) -> torch.Tensor:
    """x[rows] for block-local rows (ascending), without a copy when they are all of x's."""
    return x if len(rows) == x.shape[0] else x.index_select(0, bp.index(rows))
