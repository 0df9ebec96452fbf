"""Monte Carlo tree search over solution steps, batched across problems, on a token budget.

    trees, spent = mcts_search(prompts, expand, value, reward, MCTSConfig(simulations=16, expansions=4))
    rows = node_rows(trees[0])  # the tree, one row per node, for the store's `nodes` table

A node is one step; the root is the problem. Each simulation, for every tree still open:

1. **Select** a leaf from the root by PUCT (AlphaZero; rStar-Math, Guan et al. 2025): the child maximising
   `Q + c_puct * prior * sqrt(N_parent) / (1 + N_child)`, an unvisited child scoring `fpu` for Q. Ties go to
   the lower node id, so a search is deterministic given its callbacks.
2. **Expand** it with K candidate steps from the policy, one call for the leaves of every tree (so a backend
   call carries many nodes, and the prefixes they share are the cache's). Priors are the candidates'
   length-normalised sequence probabilities, normalised over the K siblings.
3. **Evaluate** each new child: the verifier's reward where the step ends the solution, else the value
   source (a PRM's score of the prefix, or rollouts' mean reward).
4. **Back up** each child's value along its path: visits + 1 and the value added on every node to the root.

A terminal leaf selected again backs up its reward once more (its Q is exact, so visits pile up where the
search believes).

**Progressive widening** (`widening` = alpha > 0; Couëtoux et al. 2011): a node's K draws fix its children, so a
policy sure of its next step gives a tree of a few distinct paths, and once those have ended, further simulations
only count their rewards again and spend nothing. With widening, a node whose draws so far are fewer than
`floor(N ** alpha)` rounds of K (N its visits) is expanded again on the way down: K more draws, a draw of a step
it has already joining that child (its prior, as for a seeded node, then the share of draws through it).

The budget counts generated tokens, the expansions' and whatever the value source reports, as every other
sampler does, so searches compare with plain sampling at equal tokens. A simulation expands only as many leaves
as the budget left pays for at the mean cost of a leaf so far (the trees that have spent least first), so a
search stops within about one leaf's cost of its budget, not a whole simulation's.

A tree can start from solutions drawn outside the search (`Tree.seed`: score grows trees around a round's
samples this way). Each is a path of unexpanded nodes, backed up once with its verifier's reward; a simulation
that selects such a node draws K candidate steps there, merged with the seeded ones by their text.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Candidate:
    """One proposed step: its text, its summed log-probability, its tokens, and whether it ends the solution.
    `weight`, where given, is the policy's preference directly (e.g. how many of K draws gave this step)."""

    text: str
    logprob: float
    tokens: int
    terminal: bool
    weight: float | None = None


@dataclass
class Node:
    node_id: int
    parent_id: int | None
    text: str  # this step's text; the root's is empty
    depth: int
    prior: float
    tokens: int  # generated for this step, its duplicate draws included
    draws: int = 1  # how many of the K draws gave this step (their tokens are all in `tokens`)
    terminal: bool = False
    reward: float | None = None  # the verifier's, at a terminal node
    value: float | None = None  # the value source's first estimate, at a non-terminal node
    visits: int = 0
    value_sum: float = 0.0
    children: list[int] = field(default_factory=list)
    rounds: int = 0  # times K steps were drawn here (more than once only under progressive widening)

    @property
    def expanded(self) -> bool:
        """K steps were drawn here; a seeded node has children but was never expanded."""
        return self.rounds > 0

    @property
    def q(self) -> float | None:
        return self.value_sum / self.visits if self.visits else None


@dataclass(frozen=True)
class MCTSConfig:
    simulations: int = 16  # selection rounds per tree
    expansions: int = 4  # K candidate steps per expanded leaf
    c_puct: float = 1.5
    fpu: float = 0.0  # Q assumed for an unvisited child ("first-play urgency")
    max_depth: int = 16  # steps; a leaf this deep is evaluated, never expanded
    token_budget: int | None = None  # stop once the search has generated this many tokens, all trees together
    widening: float = 0.0  # progressive widening's alpha: K more draws at a node once floor(N ** alpha) > its rounds

    def __post_init__(self) -> None:
        for name in ("simulations", "expansions", "max_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"mcts.{name} must be >= 1, got {getattr(self, name)}")
        if self.c_puct < 0:
            raise ValueError(f"mcts.c_puct must be >= 0, got {self.c_puct}")
        if self.token_budget is not None and self.token_budget < 1:
            raise ValueError(f"mcts.token_budget must be >= 1 (or null), got {self.token_budget}")
        if not 0.0 <= self.widening < 1.0:
            raise ValueError(f"mcts.widening must be in [0, 1), got {self.widening}")

    @classmethod
    def of(cls, section: Any, problems: int) -> MCTSConfig:
        """From a config's MCTS section (generate.mcts, score.tree.search), whose token budget is per problem."""
        budget = None if section.token_budget is None else section.token_budget * problems
        return cls(simulations=section.simulations, expansions=section.expansions, c_puct=section.c_puct,
                   fpu=section.fpu, max_depth=section.max_depth, token_budget=budget, widening=section.widening)


class Tree:
    """One problem's search tree; node 0 is the root (the prompt)."""

    def __init__(self, prompt: str):
        self.prompt = prompt
        self.nodes: list[Node] = [Node(0, None, "", 0, 1.0, 0)]

    def path(self, node_id: int) -> list[Node]:
        """The nodes from the root to `node_id`, both included."""
        out = []
        at: int | None = node_id
        while at is not None:
            out.append(self.nodes[at])
            at = self.nodes[at].parent_id
        return out[::-1]

    def prefix(self, node_id: int) -> str:
        """The solution so far: the steps from the root to `node_id`, joined as they were generated."""
        return "".join(n.text for n in self.path(node_id))

    def add(self, parent_id: int, c: Candidate, prior: float) -> Node:
        parent = self.nodes[parent_id]
        node = Node(len(self.nodes), parent_id, c.text, parent.depth + 1, prior, c.tokens,
                    draws=max(int(c.weight or 1), 1), terminal=c.terminal)
        self.nodes.append(node)
        parent.children.append(node.node_id)
        return node

    def seed(self, steps: list[str], reward: float) -> Node:
        """Adds a whole solution drawn outside the search, `steps` as the policy wrote them (separator included),
        as a path from the root, and backs its verifier's `reward` up along it: one simulation's worth. A step
        joins the child of the same text (stripped) and the same ending, else it is a new child; priors are the
        share of the solutions (and, once expanded, of the draws) through each child. Seeded nodes stay
        unexpanded and cost no tokens of the search's. Returns the terminal leaf."""
        if not steps:
            raise ValueError(f"Tree.seed: a solution of {self.prompt!r} with no steps")
        at = self.nodes[0]
        for i, text in enumerate(steps):
            last = i == len(steps) - 1
            same = self._child(at, text, last)
            if same is None:
                at = self.add(at.node_id, Candidate(text, 0.0, 0, last), 0.0)
            else:
                same.draws += 1
                at = same
            self._reprior(at.parent_id)
        at.reward = float(reward)
        self.backup(at.node_id, at.reward)
        return at

    def expand(self, node_id: int, cands: list[Candidate]) -> list[Node]:
        """Adds the K draws at `node_id` as its children and returns the new ones. Where seeded children are there
        already, a draw of the same step joins its node (its draws and tokens added) and priors are recomputed
        over all children from their draws."""
        leaf = self.nodes[node_id]
        leaf.rounds += 1
        if not leaf.children:
            return [self.add(node_id, c, p) for c, p in zip(cands, _priors(cands))]
        new = []
        for c in cands:
            same = self._child(leaf, c.text, c.terminal)
            if same is None:
                new.append(self.add(node_id, c, 0.0))
            else:
                same.draws += max(int(c.weight or 1), 1)
                same.tokens += c.tokens
        self._reprior(node_id)
        return new

    def _child(self, parent: Node, text: str, terminal: bool) -> Node | None:
        return next((self.nodes[c] for c in parent.children
                     if self.nodes[c].terminal == terminal and self.nodes[c].text.strip() == text.strip()), None)

    def _reprior(self, node_id: int) -> None:
        kids = [self.nodes[c] for c in self.nodes[node_id].children]
        total = sum(k.draws for k in kids)
        for k in kids:
            k.prior = k.draws / total

    def backup(self, node_id: int, value: float) -> None:
        for n in self.path(node_id):
            n.visits += 1
            n.value_sum += value

    def select(self, cfg: MCTSConfig) -> Node:
        """From the root down by PUCT to a node not yet expanded (a leaf, a terminal, or a seeded node), or, under
        progressive widening, to the first node on the way that is due K more draws."""
        node = self.nodes[0]
        while node.children and node.expanded:
            if cfg.widening and node.rounds < math.floor(node.visits ** cfg.widening):
                return node
            sqrt_n = math.sqrt(max(node.visits, 1))

            def score(cid: int) -> tuple[float, int]:
                c = self.nodes[cid]
                q = c.q if c.q is not None else cfg.fpu
                return q + cfg.c_puct * c.prior * sqrt_n / (1 + c.visits), -cid

            node = self.nodes[max(node.children, key=score)]
        return node

    def best_leaf(self) -> Node:
        """The terminal node with the highest Q (most visits, then lowest id, on ties); else the deepest
        most-visited node: what the search returns as its answer."""
        done = [n for n in self.nodes if n.terminal]
        if done:
            return max(done, key=lambda n: (n.q if n.q is not None else -math.inf, n.visits, -n.node_id))
        return max(self.nodes, key=lambda n: (n.depth, n.visits, -n.node_id))


    def returned(self, n: int) -> list[Node]:
        """The leaves a search hands back as samples: up to `n` terminal nodes, best Q first (most visits, then
        lowest id, on ties); none where no solution ended."""
        done = sorted((x for x in self.nodes if x.terminal),
                      key=lambda x: (-(x.q if x.q is not None else -math.inf), -x.visits, x.node_id))
        return done[:n]

    def path_tokens(self, node_id: int) -> int:
        """The tokens of the solution that ends at `node_id`: one draw of each step on its path."""
        return sum(x.tokens // x.draws for x in self.path(node_id))


def _priors(cands: list[Candidate]) -> list[float]:
    """The candidates' weights, normalised, where every one has a weight; else a softmax over their per-token
    log-probabilities: the policy's preference among siblings, without favouring short steps."""
    if all(c.weight is not None for c in cands):
        total = sum(c.weight for c in cands)
        return [c.weight / total for c in cands]
    per_token = [c.logprob / max(c.tokens, 1) for c in cands]
    top = max(per_token)
    w = [math.exp(x - top) for x in per_token]
    return [x / sum(w) for x in w]


def mcts_search(prompts: list[str],
                expand: Callable[[list[tuple[str, str]], int], list[list[Candidate]]],
                value: Callable[[list[tuple[str, str]]], tuple[list[float], int]],
                reward: Callable[[list[tuple[str, str]]], list[float]],
                cfg: MCTSConfig, progress: Callable[[int, int], None] | None = None,
                trees: list[Tree] | None = None) -> tuple[list[Tree], int]:
    """Search each prompt's tree (module docstring); returns the trees and the tokens generated.

    `expand(pairs, k)` gets (prompt, prefix) pairs and returns k candidate steps for each; `value(pairs)`
    returns a value in [0, 1] for each prefix and the tokens it generated (0 for a PRM; rollouts' tokens);
    `reward(pairs)` gets the (prompt, solution) pairs that ended in a simulation and returns the verifier's reward
    of each (one call a simulation, so a PRM judging held-out solutions scores them in one batch);
    `progress(simulation, tokens)`, where given, is called after each simulation. `trees`, where given, are the
    prompts' trees to search on (seeded ones, say).
    """
    if trees is None:
        trees = [Tree(p) for p in prompts]
    elif [t.prompt for t in trees] != list(prompts):
        raise ValueError("mcts: the trees given are not the prompts', in order")
    spent = grown = 0  # tokens, and leaves expanded: their mean cost sizes the last simulation to the budget
    cost = {id(t): 0 for t in trees}  # tokens per tree
    for sim in range(cfg.simulations):
        if cfg.token_budget is not None and spent >= cfg.token_budget:
            break
        leaves = [(t, t.select(cfg)) for t in trees]

        def final(leaf: Node) -> bool:  # a terminal, or as deep as the search goes: never expanded
            return leaf.terminal or (leaf.depth >= cfg.max_depth and leaf.visits > 0)

        for t, leaf in leaves:  # its reward (or value) again, no tokens
            if final(leaf):
                t.backup(leaf.node_id, leaf.reward if leaf.terminal else leaf.q)
        grow = [(t, leaf) for t, leaf in leaves if not final(leaf)]
        if cfg.token_budget is not None and spent > 0 and grow:  # expand only what the budget left pays for
            room = int((cfg.token_budget - spent) // (spent / grown))
            if room == 0:
                break
            if room < len(grow):  # the trees that have spent least so far, then in order
                keep = sorted(range(len(grow)), key=lambda i: (cost[id(grow[i][0])], i))[:room]
                grow = [grow[i] for i in sorted(keep)]
        if not grow:
            if progress:
                progress(sim + 1, spent)
            continue
        proposals = expand([(t.prompt, t.prefix(leaf.node_id)) for t, leaf in grow], cfg.expansions)
        if len(proposals) != len(grow):
            raise ValueError(f"mcts: expand returned {len(proposals)} lists of candidates for {len(grow)} leaves")
        new: list[tuple[Tree, Node]] = []
        for (t, leaf), cands in zip(grow, proposals):
            if not cands and leaf.children:  # a seeded node drew nothing new: its seeded steps stay
                leaf.rounds += 1
                continue
            if not cands:  # the policy ended the solution here: a terminal, for the verifier to judge
                leaf.terminal = True
                new.append((t, leaf))
                continue
            spent += sum(c.tokens for c in cands)
            cost[id(t)] += sum(c.tokens for c in cands)
            new += [(t, n) for n in t.expand(leaf.node_id, cands)]
        grown += len(grow)
        open_ = [(t, n) for t, n in new if not n.terminal]
        values, rollout_tokens = value([(t.prompt, t.prefix(n.node_id)) for t, n in open_]) if open_ else ([], 0)
        if len(values) != len(open_):
            raise ValueError(f"mcts: value returned {len(values)} values for {len(open_)} prefixes")
        spent += rollout_tokens
        for t, _ in open_:  # the rollouts' tokens, shared out over the prefixes they valued
            cost[id(t)] += rollout_tokens / len(open_)
        for (t, n), v in zip(open_, values):
            if not 0.0 <= v <= 1.0 or math.isnan(v):
                raise ValueError(f"mcts: value {v!r} for a prefix of {t.prompt!r} is outside [0, 1]")
            n.value = v
            t.backup(n.node_id, v)
        ends = [(t, n) for t, n in new if n.terminal]
        got = reward([(t.prompt, t.prefix(n.node_id)) for t, n in ends]) if ends else []
        if len(got) != len(ends):
            raise ValueError(f"mcts: reward returned {len(got)} rewards for {len(ends)} solutions")
        for (t, n), r in zip(ends, got):
            n.reward = float(r)
            t.backup(n.node_id, n.reward)
        if progress:
            progress(sim + 1, spent)
    return trees, spent


def node_rows(tree: Tree) -> list[dict[str, Any]]:
    """The tree as rows (the store's `nodes` table, less its ids): one per node, in creation order."""
    return [{"node_id": n.node_id, "parent_id": n.parent_id, "step_text": n.text, "depth": n.depth,
             "prior": n.prior, "visits": n.visits, "q": n.q, "value": n.value, "terminal": n.terminal,
             "reward": n.reward, "tokens": n.tokens} for n in tree.nodes]
