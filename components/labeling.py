"""Step labels for the `score` stage: Monte Carlo rollouts (Math-Shepherd) and a domain's oracle.

    items = [{"trajectory_id": "t1", "problem_id": "p1", "prompt": "3+4-2\\n",
              "steps": ["3+4=7", "7-2=5", "#### 5"], "answer_ref": "5"}]
    rows, stats = mc_step_labels(ArithDomain(), get_backend("hf", policy_path), items, k=8,
                                 temperature=0.8, max_new_tokens=96, seed=0)
    rows += oracle_labels(ArithDomain(), {p.problem_id: p for p in problems}, items)

Math-Shepherd (Wang et al. 2024, https://arxiv.org/abs/2312.08935) values a step by completing the
solution from it k times: the soft label is the fraction of completions that reach the right answer,
the hard label is whether any does. Rows are `step_labels` rows: {"trajectory_id", "step_index",
"source", "value", "num_rollouts"}.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from components.domains.base import Domain, Problem
from components.models.backends import GenerationBackend
from components.seeding import seed_stream


def mc_value(correct_flags: list[bool | float]) -> tuple[float, float]:
    """(soft, hard) Math-Shepherd value of a step from its rollouts' outcomes.

    >>> mc_value([True, False, False, True])
    (0.5, 1.0)
    >>> mc_value([0.0, 0.0])
    (0.0, 0.0)
    """
    if not correct_flags:
        raise ValueError("mc_value: no rollouts")
    hits = sum(1 for c in correct_flags if c)
    return hits / len(correct_flags), 1.0 if hits else 0.0


def _text(steps: list[str], sep: str) -> str:
    """A completion prefix: each step followed by the domain's step separator."""
    return "".join(s + sep for s in steps)


def mc_rows(tid: str, i: int, soft: float, hard: float, n: int) -> list[dict[str, Any]]:
    """A step's `mc_soft` and `mc_hard` `step_labels` rows, from `n` rollouts."""
    return [{"trajectory_id": tid, "step_index": i, "source": "mc_soft", "value": soft, "num_rollouts": n},
            {"trajectory_id": tid, "step_index": i, "source": "mc_hard", "value": hard, "num_rollouts": n}]


def _rollout_values(domain: Domain, backend: GenerationBackend, slots: list[tuple[str, str, str]], k: int,
                    temperature: float, max_new_tokens: int,
                    seed: int) -> tuple[list[tuple[float, float]], int, list[str | None]]:
    """(soft, hard) value of each (prompt, steps so far, reference) slot from k verified rollouts, all
    in ONE `generate` call, the tokens the rollouts generated, and each slot's first rollout that reached
    the answer (None: none did)."""
    if not slots:
        return [], 0, []
    samples = backend.generate([p + done for p, done, _ in slots], n=k, temperature=temperature, top_p=1.0,
                               max_new_tokens=max_new_tokens, seed=seed)
    # Verify the solution text (steps so far + continuation), not the prompt: the prompt holds numbers too.
    outcomes = domain.verify([done + s.text for (_, done, _), per in zip(slots, samples) for s in per],
                             [ref for (_, _, ref) in slots for _ in range(k)])
    values = [mc_value(outcomes[j * k:(j + 1) * k]) for j in range(len(slots))]
    wins = [next((s.text for s, ok in zip(per, outcomes[j * k:(j + 1) * k]) if ok), None)
            for j, per in enumerate(samples)]
    return values, sum(s.num_tokens for per in samples for s in per), wins


def mc_step_labels(domain: Domain, backend: GenerationBackend, items: list[dict[str, Any]], k: int, temperature: float,
                   max_new_tokens: int, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`mc_soft` and `mc_hard` rows for every step of every item, and rollout stats.

    Every non-final prefix of every trajectory goes to the backend in ONE `generate` call (n=k each),
    so the backend batches them all. Identical prefixes (same prompt, same steps so far, as when
    samples of one problem agree on their first steps) are rolled out once and share their label.
    The final step is labelled by the verifier on the trajectory itself: nothing is left to roll out.
    Items without a reference answer or without steps get no labels.
    """
    if k < 1:
        raise ValueError(f"mc_step_labels: k must be >= 1, got {k}")
    items = [it for it in items if it["answer_ref"] is not None and it["steps"]]
    slots: dict[tuple[str, str, str], int] = {}  # (prompt, steps so far, reference) -> rollout slot
    for it in items:
        for i in range(len(it["steps"]) - 1):
            slots.setdefault((it["prompt"], _text(it["steps"][:i + 1], domain.step_separator), it["answer_ref"]), len(slots))
    values, tokens, _ = _rollout_values(domain, backend, list(slots), k, temperature, max_new_tokens, seed)
    finals = domain.verify([_text(it["steps"], domain.step_separator) for it in items], [it["answer_ref"] for it in items]) if items else []

    rows: list[dict[str, Any]] = []
    for it, final in zip(items, finals):
        steps, tid = it["steps"], it["trajectory_id"]
        for i in range(len(steps) - 1):
            soft, hard = values[slots[(it["prompt"], _text(steps[:i + 1], domain.step_separator), it["answer_ref"])]]
            rows += mc_rows(tid, i, soft, hard, k)
        rows += mc_rows(tid, len(steps) - 1, float(final or 0.0), float(final or 0.0), 0)
    stats = {
        "trajectories": len(items), "steps": sum(len(it["steps"]) for it in items), "unique_prefixes": len(slots),
        "rollouts": len(slots) * k, "generated_tokens": tokens,
    }
    return rows, stats


def mc_first_error_labels(domain: Domain, backend: GenerationBackend, items: list[dict[str, Any]], k: int,
                          temperature: float, max_new_tokens: int,
                          seed: int) -> tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]]]:
    """`mc_hard` rows for every step, from rollouts at O(log n) prefixes of the wrong trajectories only, the
    search's stats, and its step-level preference pairs (`step_pairs` rows, see `_step_pairs`).

    Two facts make most of `mc_step_labels`' rollouts redundant for hard labels:

    - a trajectory that reaches the right answer is itself a successful completion of each of its
      prefixes, so every step's hard value is 1 with no rollout (`num_rollouts` 0);
    - along a wrong trajectory the hard value can only fall once: a prefix from which no completion
      succeeds stays dead as steps are added. The first dead prefix is found by binary search over
      the prefixes, as OmegaPRM does (Luo et al. 2024, https://arxiv.org/abs/2406.06592); the steps
      before it are good, it and the steps after it are bad.

    The search runs level by level: each level rolls out (k each) the middle prefix of every wrong
    trajectory still open, in ONE `generate` call, sharing identical prefixes as `mc_step_labels`
    does. Rows carry the rollouts behind them: k where the prefix was rolled out, 0 where inferred.

    The search assumes the empty prefix, the problem itself, is alive. OmegaPRM searches only
    questions some rollout solved; here an item's `root_alive` (default True) says whether any of the
    round's samples of its problem is right. Where none is, a dead prefix says nothing about where the
    error is: the policy fails the problem from the start (measured on the arith benchmark: 29-46% of
    the steps such a search called bad were right, against 4-14% where the problem was alive). Such a
    wrong trajectory is not searched, and only its final step, whose value is its verified outcome, is
    labelled (0, with 0 rollouts); its other steps get no row.
    """
    if k < 1:
        raise ValueError(f"mc_first_error_labels: k must be >= 1, got {k}")
    items = [it for it in items if it["answer_ref"] is not None and it["steps"]]
    finals = domain.verify([_text(it["steps"], domain.step_separator) for it in items], [it["answer_ref"] for it in items]) if items else []
    # bounds[j] = [lo, hi]: the first bad step of item j lies in [lo, hi]; the final step of a wrong one is bad.
    dead_root = {j for j, (it, ok) in enumerate(zip(items, finals)) if not ok and not it.get("root_alive", True)}
    bounds = {j: [0, len(it["steps"]) - 1] for j, (it, ok) in enumerate(zip(items, finals))
              if not ok and j not in dead_root}
    value: dict[tuple[str, str, str], float] = {}  # (prompt, steps so far, reference) -> hard value
    win: dict[tuple[str, str, str], str | None] = {}  # ... -> a rollout from there that reached the answer
    stats = {"trajectories": len(items), "steps": sum(len(it["steps"]) for it in items), "unique_prefixes": 0,
             "rollouts": 0, "generated_tokens": 0, "search_levels": 0, "dead_root": len(dead_root)}

    def alive(mids: dict[int, int], level: int) -> dict[int, bool]:
        keys = {j: (items[j]["prompt"], _text(items[j]["steps"][:m + 1], domain.step_separator), items[j]["answer_ref"]) for j, m in mids.items()}
        todo = sorted({key for key in keys.values() if key not in value})  # empty when all were rolled out
        values, tokens, wins = _rollout_values(domain, backend, todo, k, temperature, max_new_tokens,
                                               seed_stream(seed, level))
        value.update({key: hard for key, (_, hard) in zip(todo, values)})
        win.update(zip(todo, wins))
        stats["unique_prefixes"] += len(todo)
        stats["rollouts"] += len(todo) * k
        stats["generated_tokens"] += tokens
        return {j: bool(value[key]) for j, key in keys.items()}

    firsts, probed, stats["search_levels"] = bisect_first_dead(bounds, alive)
    rows: list[dict[str, Any]] = []
    for j, it in enumerate(items):
        tid, first_bad = it["trajectory_id"], firsts.get(j, len(it["steps"]))
        if j in dead_root:
            rows.append({"trajectory_id": tid, "step_index": len(it["steps"]) - 1, "source": "mc_hard",
                         "value": 0.0, "num_rollouts": 0})
            continue
        rows += [{"trajectory_id": tid, "step_index": i, "source": "mc_hard", "value": float(i < first_bad),
                  "num_rollouts": k if (j, i) in probed else 0} for i in range(len(it["steps"]))]
    return rows, stats, _step_pairs(domain, items, finals, firsts, win)


def bisect_first_dead(bounds: dict[Hashable, list[int]], alive: Callable[[dict[Any, int], int], dict[Any, bool]],
                      ) -> tuple[dict[Any, int], set[tuple[Any, int]], int]:
    """The first dead step of every item at once, by binary search (OmegaPRM): a prefix from which no completion
    succeeds stays dead as steps are added. `bounds[item] = [lo, hi]`: the first dead step lies in [lo, hi]. Each
    level asks `alive({item: step}, level)` whether each open item's prefix through that step (its middle one) is
    alive, in one call. Returns (item -> its first dead step, the (item, step) pairs asked about, the levels).

    >>> dead_from = {"a": 3, "b": 0, "c": 5}  # c never dies before its last step, 4
    >>> firsts, asked, levels = bisect_first_dead({"a": [0, 4], "b": [0, 4], "c": [0, 4]},
    ...                                           lambda mids, level: {i: m < dead_from[i] for i, m in mids.items()})
    >>> firsts, levels, sorted(s for i, s in asked if i == "a")
    ({'a': 3, 'b': 0, 'c': 4}, 3, [2, 3])
    """
    bounds = {item: list(b) for item, b in bounds.items()}
    asked: set[tuple[Any, int]] = set()
    levels = 0
    while any(lo < hi for lo, hi in bounds.values()):
        mids = {item: (lo + hi) // 2 for item, (lo, hi) in bounds.items() if lo < hi}
        answers = alive(mids, levels)
        levels += 1
        for item, m in mids.items():
            asked.add((item, m))
            if answers[item]:
                bounds[item][0] = m + 1
            else:
                bounds[item][1] = m
    return {item: lo for item, (lo, _) in bounds.items()}, asked, levels


def _step_pairs(domain: Domain, items: list[dict[str, Any]], finals: list[float | None], first_bad: dict[int, int],
                win: dict[tuple[str, str, str], str | None]) -> list[dict[str, Any]]:
    """Step-level preference pairs, as Step-DPO (Lai et al. 2024) and MCTS-DPO (Xie et al. 2024) build them:
    at a searched wrong trajectory's first dead step, the shared live prefix, a continuation that reached the
    answer from it (chosen: a rollout of the prefix, or where the first step itself is dead, a right sample
    of the problem) and the trajectory's own continuation (rejected). Both sides are whole solutions written
    step by step, so the pair differs from the dead step on: the preference falls on it, not on the prefix.
    """
    sep = domain.step_separator
    right: dict[str, dict[str, Any]] = {}  # problem -> its first right item, by trajectory id
    for it, ok in sorted(zip(items, finals), key=lambda x: x[0]["trajectory_id"]):
        if ok and it.get("problem_id") is not None:
            right.setdefault(it["problem_id"], it)
    pairs = []
    for j, f in sorted(first_bad.items()):
        it = items[j]
        if f > 0:
            cont = win.get((it["prompt"], _text(it["steps"][:f], sep), it["answer_ref"]))
            chosen, source = (None if cont is None else _text(domain.split_steps(cont), sep)), "rollout"
        else:
            other = right.get(it.get("problem_id"))
            chosen, source = (None, "") if other is None else (_text(other["steps"], sep), other["trajectory_id"])
        rejected = _text(it["steps"][f:], sep)
        if chosen and chosen != rejected:
            pairs.append({"trajectory_id": it["trajectory_id"], "step_index": f, "prefix": _text(it["steps"][:f], sep),
                          "chosen": chosen, "rejected": rejected, "chosen_from": source, "source": "mc",
                          "chosen_q": None, "rejected_q": None})
    return pairs


def oracle_labels(domain: Domain, problems_by_id: dict[str, Problem],
                  items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`oracle` rows (1.0 good, 0.0 bad) from `domain.oracle_step_labels`; [] for a domain without one."""
    rows = []
    for it in items:
        labels = domain.oracle_step_labels(problems_by_id[it["problem_id"]], _text(it["steps"], domain.step_separator))
        if labels is None:
            return []
        if len(labels) != len(it["steps"]):
            raise ValueError(f"oracle_labels: {it['trajectory_id']} has {len(it['steps'])} steps but the oracle "
                             f"labelled {len(labels)}; the steps must come from domain.split_steps")
        rows += [{"trajectory_id": it["trajectory_id"], "step_index": i, "source": "oracle",
                  "value": 1.0 if ok else 0.0, "num_rollouts": 0} for i, ok in enumerate(labels)]
    return rows


def first_error(ok: list[bool]) -> int:
    """Index of the first bad step, -1 if none (ProcessBench's convention).

    >>> first_error([True, False, False]), first_error([True, True])
    (1, -1)
    """
    return next((i for i, v in enumerate(ok) if not v), -1)


def prm_examples(items: list[dict[str, Any]], labels: dict[str, dict[int, dict[str, float]]], *, source: str,
                 soft_threshold: float = 0.5, prior_scores: dict[str, list[float]] | None = None,
                 consensus: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """PRM training examples from Monte Carlo labels, and a keep/drop decision per trajectory.

    `items`: {"trajectory_id", "prompt", "steps"}; `labels[tid][step][source]` the stored values.
    A trajectory is used when any step has a `source` label; a step without one is None in `labels`
    and trains nothing (first_error labels only the final step of a wrong answer to a problem the
    round never solved). Identical (prompt, steps) texts give one example. With `consensus`, a fully
    labelled trajectory the previous PRM scored is kept only when both put its first error at the
    same step (consensus filtering, Zhang et al. 2025, "The Lessons of Developing Process Reward
    Models", https://arxiv.org/abs/2501.07301); unscored and partly labelled ones are kept.

    >>> items = [{"trajectory_id": "a", "prompt": "p", "steps": ["x", "y"]},
    ...          {"trajectory_id": "b", "prompt": "q", "steps": ["x", "z"]}]
    >>> labels = {"a": {0: {"mc_hard": 1.0}, 1: {"mc_hard": 0.0}}, "b": {0: {"mc_hard": 1.0}, 1: {"mc_hard": 1.0}}}
    >>> ex, dec = prm_examples(items, labels, source="mc_hard", prior_scores={"b": [0.9, 0.1]}, consensus=True)
    >>> [(e["prompt"], e["labels"]) for e in ex], [(d["trajectory_id"], d["selected"], d["reason"]) for d in dec]
    ([('p', [True, False])], [('a', True, 'mc labels'), ('b', False, 'consensus: mc first error -1, prm 1')])
    """
    if source not in ("mc_hard", "mc_soft", "tree_hard", "tree_soft", "given"):
        raise ValueError(f"prm_examples: source must be mc_hard, mc_soft, tree_hard, tree_soft or given (imported), "
                         f"got {source!r}")
    threshold = soft_threshold if source.endswith("_soft") else 0.5
    kind = source.split("_")[0]
    examples, decisions, seen = [], [], set()
    for it in items:
        tid, per_step = it["trajectory_id"], labels.get(it["trajectory_id"], {})
        values = [per_step.get(i, {}).get(source) for i in range(len(it["steps"]))]
        if all(v is None for v in values):
            continue
        ok = [None if v is None else v >= threshold for v in values]
        partial = None in ok
        reason, keep = f"{kind} labels (final step only)" if partial else f"{kind} labels", True
        prior = (prior_scores or {}).get(tid)
        if consensus and prior is not None and not partial:
            mc_err, prm_err = first_error(ok), first_error([s >= 0.5 for s in prior])
            if mc_err != prm_err:
                reason, keep = f"consensus: {kind} first error {mc_err}, prm {prm_err}", False
        key = (it["prompt"], tuple(it["steps"]))
        if keep and key in seen:
            reason, keep = "duplicate", False
        decisions.append({"trajectory_id": tid, "selected": keep, "reason": reason})
        if keep:
            seen.add(key)
            examples.append({"prompt": it["prompt"], "completions": list(it["steps"]), "labels": ok,
                             "trajectory_id": tid})
    return examples, decisions


def demo_prm_examples(demos: dict[str, dict[str, Any]], steps_of: Any,
                      examples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """PRM examples from gold demonstrations (trajectory id -> its row), every step good, in id order,
    skipping texts already among `examples` or repeated (`train_reward.demos`). `steps_of(trajectory_id, row)`
    gives a demonstration's steps: the domain's split of its completion, or an episode's turns.

    >>> demos = {"d2": {"prompt": "p", "completion": "x\\ny\\n"}, "d1": {"prompt": "q", "completion": "x\\n"}}
    >>> got = demo_prm_examples(demos, lambda tid, t: t["completion"].splitlines(),
    ...                         [{"prompt": "q", "completions": ["x"]}])
    >>> [(e["trajectory_id"], e["completions"], e["labels"]) for e in got]
    [('d2', ['x', 'y'], [True, True])]
    """
    seen = {(e["prompt"], tuple(e["completions"])) for e in examples}
    out = []
    for tid, t in sorted(demos.items()):
        steps = steps_of(tid, t)
        if steps and (t["prompt"], tuple(steps)) not in seen:
            seen.add((t["prompt"], tuple(steps)))
            out.append({"prompt": t["prompt"], "completions": steps, "labels": [True] * len(steps), "trajectory_id": tid})
    return out
