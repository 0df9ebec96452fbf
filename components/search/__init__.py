"""Searching the space of steps while sampling.

- `step_search.prm_step_search`: draw a step, redraw it where the previous round's PRM rejects it (generate).
- `mcts`: Monte Carlo tree search over steps (PUCT selection, K expansions, verifier or value at the leaves,
  backup of Q and visits), batched across problems, with a token budget; the tree as rows for SQL.
- `training`: step labels and step preference pairs from the trees' rows (score.tree).
"""

from components.search.mcts import Candidate, MCTSConfig, Node, Tree, mcts_search, node_rows
from components.search.step_search import prm_step_search

__all__ = ["Candidate", "MCTSConfig", "Node", "Tree", "mcts_search", "node_rows", "prm_step_search"]
