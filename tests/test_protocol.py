"""DataProto: every operation checked on hand-written rows; pickling checked for size and exactness."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from mmrl.protocol import DataProto, DataProtoItem

UIDS = ["a", "b", "c", "d"]
# Ragged lists, dicts, None and an empty list: the object shapes that break naive np.array conversion.
MEDIA = [{"images": ["x.png"]}, None, {"videos": [], "fps": 2.0}, {}]
TOKENS = [[1, 2, 3], [4], [], [5, 6]]


def make_proto() -> DataProto:
    """4 rows; row i has ids [10i, 10i+1, 10i+2] and score i / 2."""
    return DataProto.from_dict(
        tensors={
            "ids": torch.arange(4).unsqueeze(1) * 10 + torch.arange(3),  # [4, 3]
            "score": torch.tensor([0.0, 0.5, 1.0, 1.5], dtype=torch.bfloat16),
            "mask": torch.tensor([[True, False], [True, True], [False, False], [False, True]]),
        },
        non_tensors={"uid": UIDS, "media": MEDIA, "tokens": TOKENS},
        meta_info={"step": 7, "temperature": 1.0},
    )


def assert_proto_equal(actual: DataProto, expected: DataProto) -> None:
    assert len(actual) == len(expected)
    tensor_keys = list(expected.batch.keys())  # iterating a TensorDict walks rows, not keys
    assert list(actual.batch.keys()) == tensor_keys
    for key in tensor_keys:
        assert actual.batch[key].dtype == expected.batch[key].dtype, key
        assert torch.equal(actual.batch[key], expected.batch[key]), key
    assert list(actual.non_tensor_batch) == list(expected.non_tensor_batch)
    for key, column in expected.non_tensor_batch.items():
        assert actual.non_tensor_batch[key].dtype == object
        assert actual.non_tensor_batch[key].tolist() == column.tolist(), key
    assert actual.meta_info == expected.meta_info


# ---------------------------------------------------------------------- construction


def test_from_dict_keeps_lists_as_objects() -> None:
    proto = DataProto.from_dict(non_tensors={"pairs": [[1, 2], [3, 4]], "grid": np.arange(6).reshape(2, 3)})
    pairs = proto.non_tensor_batch["pairs"]
    assert pairs.shape == (2,) and pairs.dtype == object
    assert pairs[0] == [1, 2] and isinstance(pairs[0], list)
    # A 2-D array becomes a column of its rows.
    assert proto.non_tensor_batch["grid"][1].tolist() == [3, 4, 5]
    assert len(proto) == 2 and list(proto.batch.keys()) == []


def test_from_dict_length_mismatch_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"tensors\['ids'\] has 4 rows but non_tensors\['uid'\] has 3"):
        DataProto.from_dict({"ids": torch.zeros(4, 2)}, {"uid": ["a", "b", "c"]})
    with pytest.raises(ValueError, match=r"tensors\['b'\] has 5"):
        DataProto.from_dict({"a": torch.zeros(4), "b": torch.zeros(5)})


def test_from_dict_rejects_non_columns() -> None:
    with pytest.raises(TypeError, match=r"non_tensors\['prompt'\]"):
        DataProto.from_dict(non_tensors={"prompt": "one string is not a column"})
    with pytest.raises(TypeError, match=r"tensors\['step'\]"):
        DataProto.from_dict(tensors={"step": torch.tensor(3)})


def test_check_consistency_catches_bad_columns() -> None:
    with pytest.raises(TypeError, match="1-D object"):
        DataProto(non_tensor_batch={"uid": np.array(["a", "b"])})
    proto = make_proto()
    proto.non_tensor_batch["uid"] = np.array(["a"], dtype=object)
    with pytest.raises(ValueError, match=r"\['uid'\] has 1 rows but the batch has 4"):
        proto.check_consistency()


# ---------------------------------------------------------------------- row access


def test_getitem_int_returns_one_row() -> None:
    proto = make_proto()
    item = proto[2]
    assert isinstance(item, DataProtoItem)
    assert item.batch["ids"].tolist() == [20, 21, 22]
    assert item.non_tensor_batch == {"uid": "c", "media": {"videos": [], "fps": 2.0}, "tokens": []}
    assert proto[-1].non_tensor_batch["uid"] == "d"
    with pytest.raises(IndexError, match="index 4 is out of range for length 4"):
        proto[4]


def test_getitem_slice_indices_and_masks() -> None:
    proto = make_proto()
    assert proto[1:3].non_tensor_batch["uid"].tolist() == ["b", "c"]
    for index in ([3, 0], np.array([3, 0]), torch.tensor([3, -4])):
        picked = proto[index]
        assert picked.non_tensor_batch["uid"].tolist() == ["d", "a"]
        assert picked.batch["ids"][:, 0].tolist() == [30, 0]
    for mask in ([False, True, False, True], torch.tensor([False, True, False, True])):
        kept = proto[mask]
        assert kept.non_tensor_batch["uid"].tolist() == ["b", "d"]
        assert kept.non_tensor_batch["tokens"].tolist() == [[4], [5, 6]]
        assert kept.batch["score"].tolist() == [0.5, 1.5]
        assert kept.meta_info == {"step": 7, "temperature": 1.0}
    assert len(proto[[]]) == 0
    with pytest.raises(IndexError, match="mask has length 3 but the batch has 4"):
        proto[[True, False, True]]
    with pytest.raises(IndexError, match=r"indices \[9\] are out of range"):
        proto[[0, 9]]


def test_reorder_returns_permuted_copy() -> None:
    proto = make_proto()
    reordered = proto.reorder(torch.tensor([2, 0, 3, 1]))
    assert reordered.non_tensor_batch["uid"].tolist() == ["c", "a", "d", "b"]
    assert reordered.batch["ids"][:, 0].tolist() == [20, 0, 30, 10]
    assert proto.non_tensor_batch["uid"].tolist() == UIDS
    with pytest.raises(ValueError, match=r"missing rows \[3\]"):
        proto.reorder([0, 1, 2, 2])


# ---------------------------------------------------------------------- columns


def test_select_shares_by_default_and_deepcopy_is_independent() -> None:
    proto = make_proto()
    shallow = proto.select(batch_keys=["ids"], non_tensor_keys=["media"], meta_info_keys=["step"])
    assert list(shallow.batch.keys()) == ["ids"] and list(shallow.non_tensor_batch) == ["media"]
    assert shallow.meta_info == {"step": 7}
    shallow.batch["ids"][0, 0] = -1
    assert proto.batch["ids"][0, 0] == -1  # shared storage

    proto = make_proto()
    deep = proto.select(deepcopy=True)
    deep.batch["ids"][0, 0] = -1
    deep.non_tensor_batch["media"][0]["images"].append("y.png")
    deep.meta_info["step"] = 8
    assert_proto_equal(proto, make_proto())
    with pytest.raises(KeyError, match=r"batch has no keys \['logits'\]"):
        proto.select(batch_keys=["logits"])


def test_pop_removes_and_returns() -> None:
    proto = make_proto()
    popped = proto.pop(batch_keys=["score"], non_tensor_keys=["media"], meta_info_keys=["temperature"])
    assert len(popped) == 4
    assert popped.batch["score"].tolist() == [0.0, 0.5, 1.0, 1.5]
    assert popped.non_tensor_batch["media"].tolist() == MEDIA
    assert popped.meta_info == {"temperature": 1.0}
    assert sorted(proto.batch.keys()) == ["ids", "mask"]
    assert sorted(proto.non_tensor_batch) == ["tokens", "uid"]
    assert proto.meta_info == {"step": 7}
    only_meta = proto.pop(meta_info_keys=["step"])
    assert len(only_meta) == 4 and only_meta.meta_info == {"step": 7}


def test_rename_tensor_and_object_columns() -> None:
    proto = make_proto()
    renamed = proto.rename({"ids": "input_ids", "uid": "prompt_uid"})
    assert sorted(renamed.batch.keys()) == ["input_ids", "mask", "score"]
    assert renamed.non_tensor_batch["prompt_uid"].tolist() == UIDS
    assert "ids" in proto.batch
    with pytest.raises(KeyError, match="would overwrite existing column 'mask'"):
        proto.rename({"ids": "mask"})
    # A swap is a rename of both keys, not an overwrite.
    swapped = proto.rename({"ids": "mask", "mask": "ids"})
    assert swapped.batch["mask"].dtype == torch.int64


def test_union_merges_and_rejects_conflicts() -> None:
    proto = make_proto()
    old_log_probs = torch.tensor([[-1.0], [-2.0], [-3.0], [-4.0]])
    extra = DataProto.from_dict(
        {"old_log_probs": old_log_probs, "ids": proto.batch["ids"].clone()},
        {"uid": list(UIDS)},
        {"step": 7, "timing_s": 0.5},
    )
    merged = proto.union(extra)
    assert torch.equal(merged.batch["old_log_probs"], old_log_probs)
    assert merged.non_tensor_batch["tokens"].tolist() == TOKENS
    assert merged.meta_info == {"step": 7, "temperature": 1.0, "timing_s": 0.5}
    assert "old_log_probs" not in proto.batch  # inputs untouched

    conflicting_ids = DataProto.from_dict({"ids": proto.batch["ids"] + 1})
    with pytest.raises(ValueError, match=r"batch\['ids'\] differs"):
        proto.union(conflicting_ids)
    conflicting_media = DataProto.from_dict(non_tensors={"media": [{}, None, {}, {}]})
    with pytest.raises(ValueError, match=r"non_tensor_batch\['media'\] differs"):
        proto.union(conflicting_media)
    with pytest.raises(ValueError, match=r"meta_info\['step'\] differs"):
        proto.union(DataProto.from_dict(non_tensors={"x": [0] * 4}, meta_info={"step": 8}))
    with pytest.raises(ValueError, match="equal lengths, got 4 and 2"):
        proto.union(proto[:2])


# ---------------------------------------------------------------------- splitting and joining


def test_chunk_then_concat_round_trip() -> None:
    proto = make_proto()
    chunks = proto.chunk(2)
    assert [chunk.non_tensor_batch["uid"].tolist() for chunk in chunks] == [["a", "b"], ["c", "d"]]
    assert_proto_equal(DataProto.concat(chunks), proto)
    with pytest.raises(ValueError, match="length 4 is not divisible into 3 equal chunks"):
        proto.chunk(3)


def test_concat_keeps_order_and_checks_meta_info() -> None:
    proto = make_proto()
    joined = DataProto.concat([proto[2:], proto[:1], proto[1:2]])
    assert joined.non_tensor_batch["uid"].tolist() == ["c", "d", "a", "b"]
    assert joined.batch["ids"][:, 0].tolist() == [20, 30, 0, 10]
    assert joined.non_tensor_batch["media"].tolist() == [MEDIA[2], MEDIA[3], MEDIA[0], MEDIA[1]]

    shard = proto[:2]
    shard.meta_info["step"] = 8
    with pytest.raises(ValueError, match=r"meta_info\['step'\] of proto 1 differs"):
        DataProto.concat([proto[2:], shard])
    with pytest.raises(ValueError, match=r"proto 1 has batch keys \['ids', 'mask'\]"):
        DataProto.concat([proto, proto.select(batch_keys=["ids", "mask"])])
    with pytest.raises(ValueError, match="empty list"):
        DataProto.concat([])


def test_split_last_piece_is_shorter() -> None:
    proto = DataProto.from_dict({"x": torch.arange(10)})
    pieces = proto.split(4)
    assert [piece.batch["x"].tolist() for piece in pieces] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_repeat_interleaved_and_tiled() -> None:
    proto = make_proto()[:2]  # uids a, b
    interleaved = proto.repeat(3, interleave=True)
    assert interleaved.non_tensor_batch["uid"].tolist() == ["a", "a", "a", "b", "b", "b"]
    assert interleaved.batch["ids"][:, 0].tolist() == [0, 0, 0, 10, 10, 10]
    assert interleaved.non_tensor_batch["tokens"].tolist() == [[1, 2, 3]] * 3 + [[4]] * 3
    tiled = proto.repeat(2, interleave=False)
    assert tiled.non_tensor_batch["uid"].tolist() == ["a", "b", "a", "b"]
    assert tiled.batch["ids"][:, 0].tolist() == [0, 10, 0, 10]
    assert tiled.meta_info == proto.meta_info


def test_pad_to_divisor_then_unpad() -> None:
    proto = DataProto.from_dict({"x": torch.arange(5)}, {"uid": list("abcde")})
    padded, pad_size = proto.pad_to_divisor(4)
    assert pad_size == 3
    assert padded.non_tensor_batch["uid"].tolist() == list("abcdeabc")
    assert padded.batch["x"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert_proto_equal(padded.unpad(pad_size), proto)

    # Padding longer than the batch wraps around.
    small = proto[:2]
    padded, pad_size = small.pad_to_divisor(7)
    assert pad_size == 5 and padded.batch["x"].tolist() == [0, 1, 0, 1, 0, 1, 0]
    padded, pad_size = proto.pad_to_divisor(5)
    assert pad_size == 0 and padded is not proto
    assert_proto_equal(padded, proto)
    with pytest.raises(ValueError, match=r"pad_size must be in \[0, 5\], got 6"):
        proto.unpad(6)


def test_to_and_repr() -> None:
    proto = make_proto()
    moved = proto.to("cpu")
    assert moved is not proto
    assert_proto_equal(moved, proto)
    text = repr(proto)
    assert "len=4" in text and "ids: int64[4, 3]" in text and "score: bfloat16[4]" in text
    assert "['media', 'tokens', 'uid']" in text and "['step', 'temperature']" in text


def test_object_columns_survive_every_op() -> None:
    proto = make_proto()
    padded, pad_size = proto.repeat(2).reorder([7, 6, 5, 4, 3, 2, 1, 0]).pad_to_divisor(3)
    pieces = padded.chunk(3)
    restored = DataProto.concat(pieces).unpad(pad_size).reorder([7, 6, 5, 4, 3, 2, 1, 0])
    restored = pickle.loads(pickle.dumps(restored.select(deepcopy=True), protocol=5))
    expected_tokens = [tokens for tokens in TOKENS for _ in range(2)]
    assert restored.non_tensor_batch["tokens"].tolist() == expected_tokens
    assert restored.non_tensor_batch["media"].tolist() == [media for media in MEDIA for _ in range(2)]
    assert restored.non_tensor_batch["tokens"].dtype == object
    assert restored.non_tensor_batch["tokens"].shape == (8,)


# ---------------------------------------------------------------------- pickling


def test_pickle_round_trip_is_exact() -> None:
    proto = make_proto()
    restored = pickle.loads(pickle.dumps(proto, protocol=5))
    assert_proto_equal(restored, proto)
    restored.batch["ids"][0, 0] = 99  # unpickled tensors are writable and do not alias the original
    assert proto.batch["ids"][0, 0] == 0


def test_pickle_size_is_raw_bytes() -> None:
    ids = torch.arange(64 * 4096, dtype=torch.int64).reshape(64, 4096)
    raw_bytes = ids.numel() * ids.element_size()
    proto = DataProto.from_dict({"input_ids": ids}, {"uid": [str(i) for i in range(64)]}, {"step": 1})
    payload = pickle.dumps(proto, protocol=5)
    assert raw_bytes <= len(payload) < 1.1 * raw_bytes
    assert torch.equal(pickle.loads(payload).batch["input_ids"], ids)
    # A chunk is a view of the full batch; it must ship its own rows only (plain torch pickling of a
    # view would write the whole 2 MiB storage).
    quarter = pickle.dumps(proto.chunk(4)[1], protocol=5)
    assert len(quarter) < 1.1 * raw_bytes / 4


def test_pickle_out_of_band_buffers_as_ray_does() -> None:
    ids = torch.arange(64 * 4096, dtype=torch.int64).reshape(64, 4096)
    proto = DataProto.from_dict(
        {"input_ids": ids, "bf": ids[:, :8].to(torch.bfloat16)}, {"uid": list(range(64))}
    )
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(proto, protocol=5, buffer_callback=buffers.append)
    assert len(payload) < 4096  # tensor bytes travel beside the stream, not inside it
    assert sum(memoryview(buffer).nbytes for buffer in buffers) == ids.numel() * 8 + 64 * 8 * 2
    # Ray's object store hands back read-only memory.
    read_only = [memoryview(bytes(memoryview(buffer))) for buffer in buffers]
    restored = pickle.loads(payload, buffers=read_only)
    assert torch.equal(restored.batch["input_ids"], ids)
    assert restored.batch["bf"].dtype == torch.bfloat16
    restored.batch["input_ids"][0, 0] = -1  # writable after the copy
    assert restored.non_tensor_batch["uid"].tolist() == list(range(64))
