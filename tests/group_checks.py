"""Assertions shared by the Ray and torchrun runs of group_scenarios: same program, same answers."""



def check_modes(out: dict) -> None:
    assert out["layouts"] == ["TP2xPP1xDP2", "TP1xPP2xDP2"]
    assert out["echo"] == [[r, 5, "x"] for r in range(4)]
    assert out["scale"] == [1, 4, 9, 16]
    assert out["rank_zero"] == 0
    assert out["custom"] == {"half": 2, "outputs": {"0": 0, "1": 10}}
    assert out["all_reduce"] == [4 * 0.5 + (0 + 1 + 2 + 3)] * 4
    # 7 rows over 4 ranks: padded to 8, one padded row dropped on the way back.
    assert out["double"] == {"y": [0, 2, 4, 6, 8, 10, 12], "rank": [0, 0, 1, 1, 2, 2, 3]}
    # TP2xDP2: ranks 0,1 are replica 0 and both saw rows 0-2; TP rank 0 (ranks 0 and 2) answers.
    assert out["mesh_tp_chunks"] == [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]
    assert out["mesh_tp"] == {"tp_sum": [0, 2, 4, 6, 8, 10], "rank": [0, 0, 0, 2, 2, 2]}
    # PP2xDP2: replica 0 is ranks 0 (stage 0) and 2 (stage 1); the last stage (ranks 2, 3) answers.
    assert out["mesh_pp_chunks"] == [[0, 1, 2], [3, 4, 5], [0, 1, 2], [3, 4, 5]]
    assert out["mesh_pp"] == {"tp_sum": [0, 1, 2, 3, 4, 5], "rank": [2, 2, 2, 3, 3, 3]}
    errors = out["errors"]
    assert "DispatchError" in errors["all_to_all_length"] and "argument 0 is length 2" in errors["all_to_all_length"]
    assert "needs at least one DataProto" in errors["dp_non_proto"]
    assert "no group method 'not_a_method'" in errors["unregistered"] and "'echo'" in errors["unregistered"]
    assert "AttributeError" in errors["private"]
    # echo, scale, rank_zero (rank 0 only), custom (ranks 0, 1), double, 2 mesh_sum on this role
    assert out["executed_before_bad_input"] == [6, 5, 4, 4]
    assert out["executed_after_bad_input"] == out["executed_before_bad_input"]  # nothing was sent


def check_colocated_and_split(out: dict) -> None:
    assert out["actor_pids"] == out["ref_pids"]  # one process per rank hosts both roles
    assert not set(out["actor_pids"]) & set(out["critic_pids"])
    assert [r[0] for r in out["ref_reads_actor"]] == [3.5, 3.5]
    assert [r[1] for r in out["ref_reads_actor"]] == out["actor_pids"]
    assert [r[2] for r in out["ref_reads_actor"]] == ["actor", "actor"]
    assert out["critic_all_reduce"] == out["actor_all_reduce"] == [1.0, 1.0]  # separate 2-rank groups
    assert "role 'actor' is already placed" in out["duplicate_role"]
    assert out["start_gap_s"] < 1.0 and out["overlap_wall_s"] < 2.9


def check_faults(out: dict) -> None:
    raised = out["raised"]
    assert raised["rank"] == 1 and raised["method"] == "fail_on" and raised["type"] == "ValueError"
    assert "bad sample on purpose at rank 1" in raised["text"] and "Traceback" in raised["text"]
    assert "group_scenarios.py" in raised["text"]  # the remote frame is in the traceback
    assert out["after_error"] == [[r, 1, "t"] for r in range(3)]
    assert out["timeout"]["ranks"] == [0, 1, 2] and "within 0.5 s" in out["timeout"]["text"]
    killed = out["killed"]
    assert isinstance(killed, dict), killed
    assert killed["rank"] == 2 and killed["method"] == "sleep" and killed["seconds"] < 10
    assert "rank 2 died during 'sleep'" in killed["text"]
    assert "rank 2 died during 'echo'" in out["after_death"] and "lost this rank earlier" in out["after_death"]
