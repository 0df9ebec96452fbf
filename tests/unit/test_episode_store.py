"""Agent episodes in the store: turns, steps and verifications committed like any stage output, read back
through `v_episodes` and `v_tool_stats`, and a version-2 store upgraded by its first writer."""

import json

import pytest

from components.envs import get_env, toolcalls
from components.envs.base import EpisodeLimits, EpisodeRunner
from components.envs.records import episode_rows
from components.manifest import Manifest, StageOutputWriter
from components.store import SCHEMA_VERSION, StageRunRef, Store, lake
from components.tables import to_table


def _episodes():
    env = get_env("calculator")
    problems = env.sample_problems(3, 3, seed=0)
    scripts = {p.prompt: [m["content"] for m in env.reference_episode(p) if m["role"] == "assistant"]
               for p in problems}
    bad = problems[0]
    scripts[bad.prompt] = ["<tool_call>{oops</tool_call>", toolcalls.format_call("calculate", {"expression": "1//0"}),
                           "#### 0"]

    def generate(conversations):
        out = []
        for conv in conversations:
            user = next(m["content"] for m in conv if m["role"] == "user")
            k = sum(m["role"] == "assistant" for m in conv)
            out.append((scripts[user][k], 5, "stop"))
        return out

    class Broken:
        def reset(self):
            return [{"role": "user", "content": "broken"}]

        def step(self, action):
            raise KeyError("no such state")

    episodes = [(p, env.episode(p)) for p in problems] + [(problems[1], Broken())]
    scripts["broken"] = ["#### 1"]
    return EpisodeRunner(generate, toolcalls.parse, EpisodeLimits(max_turns=4)).run(episodes)


def _commit(store, tmp_path, ref, records):
    tables: dict[str, list] = {}
    for i, rec in enumerate(records):
        rows = episode_rows(rec, experiment=ref.experiment, round=ref.round, purpose="train", policy_model_id=None,
                            sample_index=i, temperature=1.0, top_p=1.0, max_new_tokens=64, seed=i,
                            verifier="calculator", verifier_version="1")
        for table, r in rows.items():
            tables.setdefault(table, []).extend(r)
    store.start_stage_run(ref, "dir", "{}", "h", 1)
    out = StageOutputWriter(tmp_path / ref.stage_run_id.replace("/", "_"), ref.stage_run_id)
    for table, rows in tables.items():
        if table == "problems":
            rows = list({r["problem_id"]: r for r in rows}.values())
        out.write_table(table, to_table(table, rows))
    store.commit(ref, out.finish(Manifest(ref.experiment, ref.round, ref.stage, ref.attempt, "h", 1, None, {},
                                          timings={"total_s": 1.0})))


def test_episodes_are_stored_turn_by_turn_and_summed_in_the_views(tmp_path):
    store = Store(tmp_path / "s")
    store.register_experiment("e", "{}", "h", 1, "agent", None)
    records = _episodes()
    assert [r.status for r in records] == ["done", "done", "done", "error"]
    _commit(store, tmp_path, StageRunRef("e", 1, "generate", 1), records)

    cols, rows = store.query("SELECT episode_status, assistant_turns, tool_calls, tool_errors, reward, correct "
                             "FROM v_episodes ORDER BY trajectory_id")
    got = sorted(rows)
    assert got == sorted([("done", 3, 2, 2, 0.0, False), ("done", 2, 1, 0, 1.0, True), ("done", 2, 1, 0, 1.0, True),
                          ("error", 1, 0, 0, 0.0, None)])
    # The steps of an episode are its assistant turns; the turns keep every observation, in order.
    n_steps, = store.query("SELECT count(*) FROM steps")[1][0]
    assert n_steps == 8
    _, turns = store.query("SELECT u.role, u.tool_name, u.tool_ok, u.content, u.error FROM turns u JOIN trajectories t "
                           "USING (trajectory_id) WHERE t.finish_reason = 'done' AND t.num_tokens = 15 "
                           "ORDER BY u.turn_index")
    assert [r[0] for r in turns] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert turns[3][1:3] == ("invalid", False) and "not valid JSON" in turns[3][3]
    assert turns[5][1:3] == ("calculate", False) and turns[5][3] == "error: ValueError: division by zero"
    _, err = store.query("SELECT error FROM turns WHERE error LIKE 'Traceback%'")
    assert len(err) == 1 and "KeyError: 'no such state'" in err[0][0]

    _, stats = store.query("SELECT tool_name, calls, errors, error_rate FROM v_tool_stats ORDER BY tool_name")
    assert [r[:3] for r in stats] == [("calculate", 3, 1), ("invalid", 1, 1)] and stats[1][3] == 1.0


def test_a_turns_wall_time_is_not_its_content(tmp_path):
    """The same episodes run twice differ in their turns' `latency_s` alone: `coevo verify-reproducible` (the
    parts' content hashes) and the store's table hashes read them as the same content."""
    from components.jobs.launch import content_hashes

    ref = StageRunRef("e", 1, "generate", 1)
    got = {}
    for name in ("a", "b"):
        store = Store(tmp_path / name / "s")
        store.register_experiment("e", "{}", "h", 1, "agent", None)
        _commit(store, tmp_path / name, ref, _episodes())
        latency = store.query("SELECT list(latency_s ORDER BY trajectory_id, turn_index) FROM turns")[1][0][0]
        got[name] = (latency, content_hashes(tmp_path / name / ref.stage_run_id.replace("/", "_")),
                     store.table_hashes("e"))
    (lat_a, parts_a, tables_a), (lat_b, parts_b, tables_b) = got["a"], got["b"]
    assert lat_a != lat_b and any(x is not None for x in lat_a)  # measured anew: the subject is there
    assert "table:turns" in parts_a and parts_a == parts_b
    assert tables_a["turns"][0] > 0 and tables_a == tables_b


def test_a_version_2_store_gains_the_turns_table_from_its_first_writer(tmp_path):
    store = Store(tmp_path / "s")
    store.register_experiment("e", "{}", "h", 1, "agent", None)
    with store.writer() as con:  # what a version-2 store looks like
        con.execute("BEGIN TRANSACTION")
        con.execute("DROP VIEW v_episodes")
        con.execute("DROP VIEW v_tool_stats")
        con.execute("DROP TABLE turns")
        con.execute("DELETE FROM coevo_meta")
        con.execute("INSERT INTO coevo_meta VALUES ('schema_version', '2')")
        con.execute("COMMIT")
    store = Store(tmp_path / "s")  # this coevo opens it, as a new process would
    with pytest.raises(Exception, match="turns"):
        store.query("SELECT count(*) FROM turns")
    store.set_round_plan("e", 1, [1], "first")  # any write upgrades it
    assert store.query("SELECT count(*) FROM turns")[1] == [(0,)]
    assert store.query("SELECT max(value::INTEGER) FROM coevo_meta")[1] == [(SCHEMA_VERSION,)]
    with store.writer() as con:
        messages = [r[0] for r in con.execute(f"SELECT commit_message FROM ducklake_snapshots('{lake.LAKE}')").fetchall()]
    assert f"coevo: upgrade the store to schema {SCHEMA_VERSION}" in messages
    assert json.loads(store.query("SELECT levels_json FROM round_plans")[1][0][0]) == [1]


def test_a_version_3_store_gains_the_token_ids_column_and_keeps_its_turns(tmp_path):
    store = Store(tmp_path / "s")
    with store.writer() as con:  # what a version-3 store looks like: turns without token_ids, one row in it
        con.execute("BEGIN TRANSACTION")
        con.execute("DROP VIEW v_episodes")
        con.execute("DROP VIEW v_tool_stats")
        con.execute("ALTER TABLE turns DROP COLUMN token_ids")
        con.execute("INSERT INTO turns (trajectory_id, turn_index, role, content, stage_run_id) "
                    "VALUES ('t', 0, 'user', 'hi', 'x')")
        con.execute("DELETE FROM coevo_meta")
        con.execute("INSERT INTO coevo_meta VALUES ('schema_version', '3')")
        con.execute("COMMIT")
    store = Store(tmp_path / "s")  # this coevo opens it, as a new process would
    store.register_experiment("e", "{}", "h", 1, "agent", None)  # any write upgrades it
    assert store.query("SELECT content, token_ids FROM turns")[1] == [("hi", None)]
    assert store.query("SELECT max(value::INTEGER) FROM coevo_meta")[1] == [(SCHEMA_VERSION,)]
    assert store.query("SELECT count(*) FROM v_episodes")[1] == [(0,)]
