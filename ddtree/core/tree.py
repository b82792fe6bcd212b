"""``DraftTree``: the batched tree one round verifies (tokens, parents, depths, ancestor visibility), and the
proposer source flags that say which proposer put each node there."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import networkx

# Which proposer put a node in the tree (``DraftTree.sources`` bits): the drafter, prompt lookup, or both.
DRAFTER, LOOKUP = 1, 2
SOURCE_NAMES = {DRAFTER: "drafter", LOOKUP: "lookup", DRAFTER | LOOKUP: "both"}


@dataclass
class DraftTree:
    """A batch of token trees, all tensors ``[B, N]`` (``visibility`` is ``[B, N, N]``).

    ``scores`` is the path log-probability under the drafter (0 for the root).
    ``visibility[b, i, j]`` is True when ``j`` is ``i`` or one of its ancestors.
    ``sources`` (optional) flags which proposer put each node there
    (:data:`ddtree.core.tree.DRAFTER` / ``LOOKUP`` bits), for acceptance by source.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    visibility: torch.Tensor = field(repr=False)
    sources: torch.Tensor | None = field(default=None, repr=False)

    def row(self, b: int) -> DraftTree:
        """Row ``b`` as a batch-1 tree."""
        pick = slice(b, b + 1)
        return DraftTree(self.tokens[pick], self.parents[pick], self.depths[pick], self.scores[pick],
                         self.visibility[pick], None if self.sources is None else self.sources[pick])

    @classmethod
    def from_parents(
        cls, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor | None = None
    ) -> DraftTree:
        """Build depths and visibility from parent pointers (``parents[:, 0] == -1``)."""
        if tokens.dim() == 1:
            tokens, parents = tokens[None], parents[None]
            scores = None if scores is None else scores[None]
        if tokens.shape != parents.shape:
            raise ValueError(f"tokens {tuple(tokens.shape)} and parents {tuple(parents.shape)} differ in shape")
        bsz, n = tokens.shape
        if n == 0:
            raise ValueError("a draft tree needs at least the root node, got 0 nodes")
        idx = torch.arange(n, device=tokens.device)
        if (parents[:, 0] != -1).any() or (n > 1 and ((parents[:, 1:] < 0) | (parents[:, 1:] >= idx[1:])).any()):
            raise ValueError("parents must be -1 for the root and point to an earlier node for every other node")
        depths, visibility = _depths_and_visibility(parents)
        if scores is None:
            scores = torch.zeros(bsz, n, dtype=torch.float32, device=tokens.device)
        return cls(tokens, parents, depths, scores, visibility)

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        """Nodes including the root."""
        return self.tokens.shape[1]

    @property
    def budget(self) -> int:
        return self.num_nodes - 1

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    def children(self, node: int, row: int = 0) -> list[int]:
        """Indices of ``node``'s children in row ``row``, in index order."""
        return torch.nonzero(self.parents[row] == node).flatten().tolist()

    def child_table(self, row: int = 0) -> dict[int, dict[int, int]]:
        """``{node: {token: child}}`` for row ``row``; a convenience for custom walks."""
        table: dict[int, dict[int, int]] = {}
        for child, (parent, tok) in enumerate(zip(self.parents[row].tolist(), self.tokens[row].tolist())):
            if parent >= 0:
                table.setdefault(parent, {})[tok] = child
        return table

    def to_networkx(self, row: int = 0) -> networkx.DiGraph:
        """A ``networkx.DiGraph`` with edges parent -> child and node attributes token, depth, score.
        networkx is optional (the ``graph`` extra): nothing else in ddtree needs it."""
        try:
            import networkx as nx
        except ImportError as err:
            raise ImportError("DraftTree.to_networkx needs networkx, an optional dependency: "
                              "pip install 'ddtree[graph]'") from err

        g = nx.DiGraph()
        toks, deps, scs, pars = (t[row].tolist() for t in (self.tokens, self.depths, self.scores, self.parents))
        for i, (tok, dep, sc) in enumerate(zip(toks, deps, scs)):
            g.add_node(i, token=tok, depth=dep, score=sc)
        g.add_edges_from((p, i) for i, p in enumerate(pars) if p >= 0)
        return g

    def to_dict(self, row: int = 0) -> dict:
        """Plain lists, for JSON."""
        return {
            "tokens": self.tokens[row].tolist(),
            "parents": self.parents[row].tolist(),
            "scores": [float(s) for s in self.scores[row].tolist()],
        }

    @classmethod
    def from_dict(cls, data: dict) -> DraftTree:
        return cls.from_parents(
            torch.tensor(data["tokens"]), torch.tensor(data["parents"]), torch.tensor(data.get("scores"))
            if data.get("scores") is not None else None,
        )


def _depths_and_visibility(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pointer jumping over ancestors: one vectorised step per depth level."""
    bsz, n = parents.shape
    device = parents.device
    visibility = torch.eye(n, dtype=torch.bool, device=device).expand(bsz, n, n).clone()
    depths = torch.zeros(bsz, n, dtype=torch.long, device=device)
    rows = torch.arange(bsz, device=device)[:, None]
    cols = torch.arange(n, device=device).expand(bsz, n)
    ancestor = parents.clone()
    while True:
        live = ancestor >= 0
        if not live.any():
            break
        depths += live.long()
        safe = ancestor.clamp(min=0)
        visibility[rows.expand(bsz, n)[live], cols[live], safe[live]] = True
        ancestor = torch.where(live, parents.gather(1, safe), ancestor)
    return depths, visibility


def first_path(tree: DraftTree) -> torch.Tensor:
    """``[B, N]`` bool: the nodes on each row's first path, from the root through each node's first child (the
    lowest index), root excluded. A builder places a node's children best first, so this is the drafter's
    best guess at every depth it reached: what a drafter that is right accepts. No host read, no loop."""
    n = tree.num_nodes
    index = torch.arange(n, device=tree.tokens.device)
    earlier = index[None, :] < index[:, None]  # [i, j]: j comes before i
    later_sibling = ((tree.parents[:, :, None] == tree.parents[:, None, :]) & earlier).any(dim=2)
    later_sibling[:, 0] = False  # the root is nobody's child
    # A node is on the first path when neither it nor any ancestor has an earlier sibling (pads see only
    # themselves: a pad is a root copy with parent -1, like the root, so the root's index makes it "later").
    on = ~(tree.visibility & later_sibling[:, None, :]).any(dim=2)
    return on & (index > 0) & (tree.parents >= 0)


def root_only(root_tokens: torch.Tensor, dtype: torch.dtype = torch.float32) -> DraftTree:
    """The tree of the roots alone: verifying it is one plain decode step per row."""
    return path_tree(root_tokens.view(-1, 1), torch.zeros(root_tokens.shape[0], 1, dtype=dtype,
                                                          device=root_tokens.device))


def path_tree(tokens: torch.Tensor, scores: torch.Tensor) -> DraftTree:
    """A batch of single paths ``[B, N]`` (node 0 the root, each node the child of the one before), built
    from shapes alone: no validation reads of tensor values, so a device round can call it."""
    bsz, n = tokens.shape
    device = tokens.device
    idx = torch.arange(n, device=device)
    return DraftTree(
        tokens.long(),
        (idx - 1).repeat(bsz, 1),
        idx.repeat(bsz, 1),
        scores,
        torch.ones(n, n, dtype=torch.bool, device=device).tril().repeat(bsz, 1, 1),
    )
