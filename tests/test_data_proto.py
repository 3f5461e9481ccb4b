import pickle

import numpy as np
import pytest
import torch

from workers import DataProto


def make(n=6, offset=0):
    return DataProto(
        {"ids": torch.arange(offset, offset + n).repeat_interleave(3).reshape(n, 3), "score": torch.arange(n) * 0.5},
        {"text": [f"s{offset + i}" for i in range(n)]},
        {"temperature": 1.0},
    )


def test_construction_checks_batch_sizes_and_names_the_keys():
    with pytest.raises(ValueError, match=r"a=3, b=4"):
        DataProto({"a": torch.zeros(3), "b": torch.zeros(4)})
    with pytest.raises(ValueError, match=r"a=3, text=2"):
        DataProto({"a": torch.zeros(3)}, {"text": ["x", "y"]})
    with pytest.raises(TypeError, match="'a' must be a torch.Tensor"):
        DataProto({"a": [1, 2]})


def test_lists_become_object_arrays_and_len():
    dp = make(4)
    assert len(dp) == 4
    assert dp.non_tensor_batch["text"].dtype == object
    assert dp["text"][2] == "s2"


def test_chunk_split_and_concat_round_trip():
    dp = make(6)
    parts = dp.chunk(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    assert parts[1]["text"].tolist() == ["s2", "s3"]
    assert [len(p) for p in dp.split(4)] == [4, 2]
    back = DataProto.concat(parts)
    assert torch.equal(back["ids"], dp["ids"]) and back["text"].tolist() == dp["text"].tolist()
    assert back.meta_info == {"temperature": 1.0}


def test_chunk_that_does_not_divide_points_to_padding():
    with pytest.raises(ValueError, match=r"length 5 into 2 .*pad_to_divisor\(2\)"):
        make(5).chunk(2)


def test_concat_refuses_mismatched_keys():
    a, b = make(2), make(2).select(batch_keys=["ids"])
    with pytest.raises(ValueError, match="part 1 has keys"):
        DataProto.concat([a, b])


def test_union_merges_and_refuses_conflicts():
    left = make(3).select(batch_keys=["ids"], non_tensor_batch_keys=[])
    right = DataProto({"adv": torch.ones(3), "ids": left["ids"].clone()})
    merged = left.union(right)
    assert set(merged.batch) == {"ids", "adv"}
    assert "adv" not in left.batch  # inputs untouched
    bad = DataProto({"ids": left["ids"] + 1})
    with pytest.raises(ValueError, match="tensor 'ids' differs"):
        left.union(bad)
    with pytest.raises(ValueError, match=r"batch sizes differ \(3 vs 2\)"):
        left.union(DataProto({"x": torch.zeros(2)}))
    with pytest.raises(ValueError, match="meta_info 'temperature' differs"):
        make(3).union(DataProto({"x": torch.zeros(3)}, meta_info={"temperature": 0.5}))


def test_repeat_interleaved_and_tiled():
    dp = make(2)
    inter = dp.repeat(3)
    assert inter["score"].tolist() == [0.0, 0.0, 0.0, 0.5, 0.5, 0.5]
    assert inter["text"].tolist() == ["s0"] * 3 + ["s1"] * 3
    tiled = dp.repeat(2, interleave=False)
    assert tiled["ids"][:, 0].tolist() == [0, 1, 0, 1]
    assert tiled["text"].tolist() == ["s0", "s1", "s0", "s1"]


def test_select_pop_and_indexing():
    dp = make(4)
    sel = dp.select(batch_keys=["score"], non_tensor_batch_keys=[])
    assert sel.keys() == ["score"]
    with pytest.raises(KeyError, match=r"no keys \['nope'\]"):
        dp.select(batch_keys=["nope"])
    popped = dp.pop(batch_keys=["score"])
    assert popped.keys() == ["score"] and "score" not in dp.batch and len(dp) == 4
    assert dp[1:3]["text"].tolist() == ["s1", "s2"]
    assert dp[[3, 0]]["ids"][:, 0].tolist() == [3, 0]
    assert dp[torch.tensor([True, False, True, False])]["text"].tolist() == ["s0", "s2"]
    assert dp[-1]["text"].tolist() == ["s3"]
    with pytest.raises(KeyError, match="'missing' is not in this DataProto"):
        dp["missing"]


def test_padding_round_trip_repeats_real_rows():
    dp = make(5)
    padded, pad = dp.pad_to_divisor(4)
    assert pad == 3 and len(padded) == 8
    assert padded["text"].tolist()[5:] == ["s0", "s1", "s2"]
    restored = padded.unpad(pad)
    assert torch.equal(restored["ids"], dp["ids"])
    same, zero = make(4).pad_to_divisor(2)
    assert zero == 0 and len(same) == 4


def test_make_iterator_is_seeded_and_covers_every_row_each_epoch():
    dp = make(8)
    first = [mb["score"].tolist() for mb in dp.make_iterator(4, epochs=2, seed=7)]
    second = [mb["score"].tolist() for mb in dp.make_iterator(4, epochs=2, seed=7)]
    other = [mb["score"].tolist() for mb in dp.make_iterator(4, epochs=2, seed=8)]
    assert first == second and first != other
    assert len(first) == 4
    assert sorted(first[0] + first[1]) == sorted(dp["score"].tolist())
    assert sorted(first[2] + first[3]) == sorted(dp["score"].tolist())
    assert first[:2] != first[2:]  # a new order in the second epoch
    with pytest.raises(ValueError, match="mini_batch_size 3 must be positive and divide the batch size 8"):
        next(dp.make_iterator(3))


def test_operations_do_not_mutate_inputs():
    dp = make(4)
    before = {k: v.clone() for k, v in dp.batch.items()}, dp["text"].copy(), dict(dp.meta_info)
    dp.chunk(2), dp.repeat(2), dp.pad_to_divisor(3), dp.union(DataProto({"z": torch.zeros(4)}))
    DataProto.concat([dp, dp]), dp.select(["ids"]), dp[::2]
    assert all(torch.equal(before[0][k], dp.batch[k]) for k in before[0])
    assert dp["text"].tolist() == before[1].tolist() and dp.meta_info == before[2]
    assert set(dp.batch) == {"ids", "score"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16])
def test_pickle_protocol5_is_out_of_band_and_exact(dtype):
    x = (torch.randn(64, 33) * 10).to(dtype)
    dp = DataProto({"x": x, "empty": torch.zeros(64, 0)}, {"t": list(range(64))}, {"step": 3})
    buffers = []
    payload = pickle.dumps(dp, protocol=5, buffer_callback=buffers.append)
    # The tensor bytes travel out of band, as a view of the tensor's own memory.
    assert len(payload) < x.numel() * x.element_size() / 2 + 2000
    raws = [b.raw() for b in buffers]
    assert any(np.frombuffer(r, np.uint8).ctypes.data == x.data_ptr() for r in raws)
    back = pickle.loads(payload, buffers=[bytearray(r) for r in raws])
    assert back["x"].dtype == dtype and torch.equal(back["x"], x)
    assert back["empty"].shape == (64, 0)
    assert back["t"].tolist() == list(range(64)) and back.meta_info == {"step": 3}
    back["x"][0] = back["x"][1]  # writable


def test_pickle_in_band_and_older_protocols():
    dp = make(3)
    for protocol in (2, 4, 5):
        back = pickle.loads(pickle.dumps(dp, protocol=protocol))
        assert torch.equal(back["ids"], dp["ids"]) and back["text"].tolist() == dp["text"].tolist()
        back["ids"][0, 0] = 99  # writable, and a copy
        assert dp["ids"][0, 0] == 0
