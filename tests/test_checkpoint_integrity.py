"""Checksums of a checkpoint's files, without a process group: each kind of damage is found and named."""

from controller.rl.checkpoint_integrity import checksums, verify


def test_missing_torn_and_changed_files_are_each_named(tmp_path):
    step = tmp_path / "actor" / "step_00000001"
    (step / "rng").mkdir(parents=True)
    for name, size in (("__0_0.distcp", 100_000), ("__0_1.distcp", 100_000), ("rng/rank_00000.pt", 10)):
        (step / name).write_bytes(bytes(i % 251 for i in range(size)))
    schedule = tmp_path / "trainer" / "step_00000001.schedule.pt"
    schedule.parent.mkdir()
    schedule.write_bytes(b"ahead")
    files = checksums(tmp_path, [step, schedule, tmp_path / "not_written.pt"])
    assert sorted(files) == ["actor/step_00000001/__0_0.distcp", "actor/step_00000001/__0_1.distcp",
                             "actor/step_00000001/rng/rank_00000.pt", "trainer/step_00000001.schedule.pt"]
    assert verify(tmp_path, files) == []
    (step / "__0_0.distcp").write_bytes((step / "__0_0.distcp").read_bytes()[:4096])  # cut short
    data = bytearray((step / "__0_1.distcp").read_bytes())
    data[77_777] ^= 0x10  # one bit
    (step / "__0_1.distcp").write_bytes(bytes(data))
    schedule.unlink()
    problems = verify(tmp_path, files)
    assert problems[0] == "actor/step_00000001/__0_0.distcp: 4096 bytes, 100000 written (torn)"
    assert problems[1].startswith("actor/step_00000001/__0_1.distcp: sha256 ") and problems[1].endswith("(changed)")
    assert problems[2] == "trainer/step_00000001.schedule.pt: missing"
    assert len(problems) == 3  # the untouched file passes
