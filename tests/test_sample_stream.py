"""The async sample stream's rules, with no process: admission under the staleness bound, partial rollouts
with per-token versions, group readiness, stale groups dropped and counted, the batch layout against
``build_rollout_batch``, and a checkpoint mid-stream that loses and repeats nothing.

The rollout here is a pure function of (prompt, tokens so far, weights version), answering
``Rollout.generate_chunk``'s contract: the real method's own test continues greedy responses across calls
(tests/rollout/test_rollout_engines.py).
"""

import pytest
import torch

from controller.rl.sample_stream import SampleStream
from workers.data_proto import DataProto
from workers.rollout.batch import Completion, GenerationRequest, build_rollout_batch
from workers.rollout.sampling import SamplingConfig

EOS, PAD = 1, 0


def next_token(prompt: list[int], tokens: list[int], version: int) -> int:
    """The toy policy: a deterministic token; EOS when the prompt's lengths say so."""
    if len(tokens) == prompt[0] % 7 + 2:  # responses of 2..8 tokens, unless max_new_tokens cuts them
        return EOS
    return 2 + (sum(prompt) * 31 + len(tokens) * 7 + version * 13) % 90


def log_prob(token: int, version: int) -> float:
    return -0.01 * token - 0.1 * version


def rollout_chunk(chunk: DataProto, version: int) -> DataProto:
    """``Rollout.generate_chunk`` for the toy policy."""
    limit = chunk.meta_info["sampling"]["max_new_tokens"]
    responses, mask = chunk.batch["responses"].clone(), chunk.batch["response_mask"].clone()
    log_probs = chunk.batch["rollout_log_probs"].clone()
    width = responses.shape[1]
    finished, reasons = [], []
    for row in range(len(chunk)):
        prompt = chunk.batch["prompts"][row][chunk.batch["prompt_mask"][row].bool()].tolist()
        length = int(mask[row].sum())
        tokens = responses[row, :length].tolist()
        stop = False
        for _ in range(min(limit, width - length)):
            token = next_token(prompt, tokens, version)
            responses[row, len(tokens)], mask[row, len(tokens)] = token, 1
            log_probs[row, len(tokens)] = log_prob(token, version)
            tokens.append(token)
            if token == EOS:
                stop = True
                break
        finished.append(stop or len(tokens) == width)
        reasons.append("stop" if stop else "length")
    return DataProto({"responses": responses, "response_mask": mask, "rollout_log_probs": log_probs,
                      "finished": torch.tensor(finished)}, {"finish_reason": reasons}, {"temperature": 1.0})


class Loader:
    """Prompts of 1..5 tokens, uid p<i>, in order; its position is a checkpoint's."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size, self.position = batch_size, 0

    def next_batch(self) -> DataProto:
        rows = [[3 + (i * 5) % 40] + [10 + i % 9] * (i % 5) for i in range(self.position, self.position + self.batch_size)]
        uids = [f"p{i}" for i in range(self.position, self.position + self.batch_size)]
        self.position += self.batch_size
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), PAD, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
        return DataProto({"input_ids": ids, "attention_mask": mask}, {"uid": uids, "ground_truth": uids})


def launch(stream: SampleStream, loader: Loader, version: int):
    """What AsyncStream._launch does: draw what may start, make the chunk (None: nothing to generate)."""
    while stream.wants_prompts(version):
        stream.add_prompts(loader.next_batch())
    chunk = stream.next_chunk(version)
    return None if chunk is None else (chunk, list(stream.generating), version)


def finish(stream: SampleStream, in_flight) -> None:
    if in_flight is not None:
        chunk, sent, version = in_flight
        stream.add_chunk(sent, rollout_chunk(chunk, version), version)


def run(stream: SampleStream, loader: Loader, steps: range, in_flight=None, log=None):
    """AsyncStream's step order: at step v the rollout gets weights v after the chunk in flight ends; chunks
    until a batch is ready; the batch; one more chunk launched to run while the step trains."""
    batches = []
    for version in steps:
        finish(stream, in_flight)  # the update interrupts here: the chunk in flight ran on version - 1
        in_flight = None
        if log is not None:
            log.append(stream.partial_samples())
        stream.drop_stale(version)
        while not stream.has_batch():
            in_flight = launch(stream, loader, version)
            assert in_flight is not None, "stuck"
            finish(stream, in_flight)
            in_flight = None
            stream.drop_stale(version)
        batch, prompts = stream.take_batch()
        batches.append((version, batch, prompts))
        in_flight = launch(stream, loader, version)
    return batches, in_flight


def trained_samples(batches) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    out = []
    for _, batch, _ in batches:
        for row in range(len(batch)):
            mask = batch.batch["response_mask"][row].bool()
            out.append((batch.non_tensor_batch["uid"][row], tuple(batch.batch["responses"][row][mask].tolist()),
                        tuple(batch.batch["token_versions"][row][mask].tolist())))
    return out


def make_stream(**kwargs) -> SampleStream:
    settings = dict(batch_size=4, n=2, max_new_tokens=6, chunk_tokens=2, max_staleness=1, pad_token_id=PAD)
    return SampleStream(**{**settings, **kwargs})


def test_admission_keeps_each_group_within_the_staleness_bound():
    stream, loader = make_stream(), Loader(4)
    assert stream.room(0) == 8  # (0 + 1 + 1) x 4: groups trained at versions 0 and 1 may start at version 0
    batches, _ = run(stream, loader, range(8))
    for version, batch, _ in batches:
        stale = version - batch.batch["policy_version"]
        assert int(stale.max()) <= 1 and len(batch) == 8
    assert stream.dropped == 0
    # max_in_flight caps the groups in generation at once; the stream still fills every batch.
    capped = make_stream(max_in_flight=3)
    run(capped, Loader(4), range(1))
    assert capped.groups_in_generation() <= 3
    batches, _ = run(capped, Loader(4), range(6))
    assert all(len(b) == 8 for _, b, _ in batches)


def test_a_weight_update_interrupts_partial_samples_which_record_each_tokens_version():
    stream, log = make_stream(), []
    batches, _ = run(stream, Loader(4), range(6), log=log)
    assert any(log[1:])  # samples were in the middle of their responses at the updates
    mixed = 0
    for version, batch, _ in batches:
        versions, mask = batch.batch["token_versions"], batch.batch["response_mask"].bool()
        assert (versions[~mask] == -1).all()
        for row in range(len(batch)):
            v = versions[row][mask[row]]
            assert (v[1:] >= v[:-1]).all() and int(v.max()) <= version  # versions only go up, never ahead
            assert int(batch.batch["policy_version"][row]) == int(v.min())  # a sample is as old as its first token
            # chunks of 2: a version holds for whole chunks (the last one may be cut by EOS)
            assert all(len(set(v[i:i + 2].tolist())) == 1 for i in range(0, len(v), 2))
            mixed += int(v.max() > v.min())
            expected = [next_token(prompt_of(batch, row), batch.batch["responses"][row][:i].tolist(), int(v[i]))
                        for i in range(len(v))]
            assert batch.batch["responses"][row][mask[row]].tolist() == expected
            assert torch.allclose(batch.batch["rollout_log_probs"][row][mask[row]],
                                  torch.tensor([log_prob(t, int(x)) for t, x in zip(expected, v)]))
    assert mixed > 0


def prompt_of(batch: DataProto, row: int) -> list[int]:
    return batch.batch["prompts"][row][batch.batch["attention_mask"][row, :batch.batch["prompts"].shape[1]].bool()].tolist()


def test_a_group_is_ready_once_all_its_samples_end_and_batches_are_prompt_major():
    stream, loader = make_stream(n=3, chunk_tokens=1), Loader(4)
    version = 0
    in_flight = launch(stream, loader, version)
    finish(stream, in_flight)
    assert not stream.ready  # one token each: no response has ended yet
    while not stream.has_batch():
        finish(stream, launch(stream, loader, version))
    batch, prompts = stream.take_batch()
    uids = batch.non_tensor_batch["uid"]
    assert [list(uids[i * 3:(i + 1) * 3]) for i in range(4)] == [[u] * 3 for u in prompts.non_tensor_batch["uid"]]
    assert len(set(prompts.non_tensor_batch["uid"])) == 4 and len(prompts) == 4
    assert all(r in ("stop", "length") for r in batch.non_tensor_batch["finish_reason"])


def test_stale_groups_are_dropped_ready_or_in_generation_and_counted():
    stream, loader = make_stream(max_staleness=2), Loader(4)
    run(stream, loader, range(1))
    # The trainer jumps 3 updates ahead (as a resumed run with older samples would): everything is too old.
    begun = ({s.group for s in stream.generating if s.tokens} | set(stream.waiting)
             | {g[0].group for g in stream.ready})
    assert stream.ready and begun
    dropped = stream.drop_stale(4)
    assert stream.dropped == len(begun) and dropped == stream.dropped_samples == 2 * len(begun)
    assert not stream.ready and all(not s.tokens for s in stream.generating)
    m = stream.metrics()
    assert m["stream/groups_drawn"] == (m["stream/groups_trained"] + m["stream/groups_dropped"] + m["stream/groups_pending"]
                                        + m["stream/groups_in_generation"] + m["stream/groups_ready"])


def test_the_batch_is_the_rollout_batch_of_the_same_completions():
    """A stream whose chunk is the whole response gives exactly build_rollout_batch's tensors."""
    stream, loader = make_stream(chunk_tokens=6, max_staleness=0), Loader(4)
    (version, batch, prompts), = run(stream, loader, range(1))[0]
    sampling = SamplingConfig(max_new_tokens=6, n=2)
    requests, completions = [], []
    for i in range(len(prompts)):
        ids = prompts.batch["input_ids"][i][prompts.batch["attention_mask"][i].bool()].tolist()
        for _ in range(2):
            tokens = []
            while len(tokens) < 6 and (not tokens or tokens[-1] != EOS):
                tokens.append(next_token(ids, tokens, 0))
            requests.append(GenerationRequest(tuple(ids), None))
            completions.append(Completion(tokens, [log_prob(t, 0) for t in tokens],
                                          "stop" if tokens[-1] == EOS else "length"))
    expected = build_rollout_batch(prompts, requests, completions, sampling, 64, PAD)
    for key in ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask"):
        assert torch.equal(batch.batch[key], expected.batch[key]), key
    assert torch.allclose(batch.batch["rollout_log_probs"], expected.batch["rollout_log_probs"])
    assert list(batch.non_tensor_batch["finish_reason"]) == list(expected.non_tensor_batch["finish_reason"])
    assert batch.meta_info["temperature"] == 1.0


def test_a_checkpoint_mid_stream_loses_and_repeats_no_sample(tmp_path):
    whole_stream = make_stream()
    whole, _ = run(whole_stream, Loader(4), range(8))

    stream, loader = make_stream(), Loader(4)
    first, in_flight = run(stream, loader, range(3))
    finish(stream, in_flight)  # the checkpoint waits for the chunk in flight
    torch.save({"stream": stream.state_dict(), "loader": loader.position}, tmp_path / "stream.pt")
    saved = torch.load(tmp_path / "stream.pt", weights_only=False)
    resumed, resumed_loader = make_stream(), Loader(4)
    resumed.load_state_dict(saved["stream"])
    resumed_loader.position = saved["loader"]
    rest, _ = run(resumed, resumed_loader, range(3, 8))

    samples = trained_samples(first + rest)
    assert samples == trained_samples(whole)  # the same samples, tokens and versions, in the same order
    uids = [uid for uid, _, _ in samples]
    assert len(samples) == 8 * 8 and all(uids.count(u) == 2 for u in uids)  # each group once, both samples
    assert resumed.metrics() == whole_stream.metrics()
    m = resumed.metrics()  # every group drawn is trained, dropped, or still between the loader and training
    assert m["stream/groups_drawn"] == sum(m[f"stream/groups_{k}"] for k in ("trained", "dropped", "pending",
                                                                              "in_generation", "ready"))


def test_bad_stream_settings_are_named():
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1, got 0; max_staleness must be >= 0, got -1"):
        make_stream(chunk_tokens=0, max_staleness=-1)
    with pytest.raises(RuntimeError, match="0 ready groups, fewer than the batch's 4"):
        make_stream().take_batch()
