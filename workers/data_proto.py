"""DataProto: the batch that flows between the controller and worker groups.

A DataProto holds named tensors that share their first (batch) dimension,
named numpy object arrays with the same first dimension (strings, dicts,
anything per sample), and a free-form ``meta_info`` dict (temperature, step,
metrics). Every operation returns a new DataProto and leaves its inputs as
they were; tensors are shared, never copied, unless an operation has to
build new rows (concat, repeat, padding, index selection). ``pop`` is the
one operation that changes its receiver, as its name says.

Pickling sends tensor payloads as pickle protocol 5 out-of-band buffers, so
a transport that keeps buffers separate (ours, Ray's object store) moves the
bytes without an extra serialisation copy. Unpickled from Ray's object store,
the tensors are zero-copy views of its shared memory: a worker method that
writes into its input tensors in place must be registered with
``writes_inputs=True`` (it then gets private copies), or ``.clone()`` them.
"""

from __future__ import annotations

import pickle
import warnings
from typing import Any, Iterator, Sequence

import numpy as np
import torch

__all__ = ["DataProto"]

TensorDict = dict[str, torch.Tensor]
ArrayDict = dict[str, np.ndarray]


def _as_object_array(key: str, value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (list, tuple)):
        arr = np.empty(len(value), dtype=object)
        arr[:] = list(value)
        return arr
    raise TypeError(
        f"non-tensor entry {key!r} must be a numpy array or a list, got {type(value).__name__}"
    )


def _batch_size(batch: TensorDict, non_tensor: ArrayDict) -> int:
    sizes = {k: int(v.shape[0]) for k, v in batch.items()}
    sizes.update({k: int(v.shape[0]) for k, v in non_tensor.items()})
    distinct = set(sizes.values())
    if len(distinct) > 1:
        listing = ", ".join(f"{k}={n}" for k, n in sizes.items())
        raise ValueError(f"DataProto entries disagree on batch size: {listing}")
    return distinct.pop() if distinct else 0


class DataProto:
    """A batch of named tensors, named non-tensor arrays and meta_info."""

    __slots__ = ("batch", "non_tensor_batch", "meta_info", "_size")

    def __new__(cls, *args: Any, **fields: Any):
        """``DataProto(batch, non_tensor_batch, meta_info)``: a batch. ``DataProto(field="name", ...)``, names
        only: a schema, the fields a stage must produce (``workers.data_schema.DataSchema``)."""
        known = {"batch", "non_tensor_batch", "meta_info"}
        if fields and not args and not known & set(fields):
            from workers.data_schema import DataSchema

            return DataSchema(dict(fields))
        return super().__new__(cls)

    def __init__(
        self,
        batch: TensorDict | None = None,
        non_tensor_batch: dict[str, Any] | None = None,
        meta_info: dict[str, Any] | None = None,
    ) -> None:
        batch = dict(batch or {})
        for key, value in batch.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"batch entry {key!r} must be a torch.Tensor, got {type(value).__name__}; "
                    "put per-sample Python objects in non_tensor_batch"
                )
            if value.dim() == 0:
                raise ValueError(f"batch entry {key!r} is a scalar; batch tensors need a batch dimension")
        non_tensor = {k: _as_object_array(k, v) for k, v in (non_tensor_batch or {}).items()}
        for key, value in non_tensor.items():
            if value.ndim == 0:
                raise ValueError(f"non-tensor entry {key!r} is a scalar; it needs a batch dimension")
        self.batch: TensorDict = batch
        self.non_tensor_batch: ArrayDict = non_tensor
        self.meta_info: dict[str, Any] = dict(meta_info or {})
        self._size = _batch_size(batch, non_tensor)

    @classmethod
    def from_dict(
        cls,
        tensors: TensorDict | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict[str, Any] | None = None,
    ) -> "DataProto":
        return cls(tensors, non_tensors, meta_info)

    # ------------------------------------------------------------------ basics
    def __len__(self) -> int:
        return self._size

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor payload (what a transport moves for ``batch``)."""
        return sum(t.numel() * t.element_size() for t in self.batch.values())

    def keys(self) -> list[str]:
        return list(self.batch) + list(self.non_tensor_batch)

    def __contains__(self, key: str) -> bool:
        return key in self.batch or key in self.non_tensor_batch

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}:{tuple(v.shape)}:{str(v.dtype).replace('torch.', '')}" for k, v in self.batch.items())
        arrays = ", ".join(self.non_tensor_batch)
        return f"DataProto(len={len(self)}, batch=[{tensors}], non_tensor=[{arrays}], meta_info={sorted(self.meta_info)})"

    def __getitem__(self, item: Any) -> Any:
        """``dp["key"]`` returns one entry; ints, slices and index arrays return rows."""
        if isinstance(item, str):
            if item in self.batch:
                return self.batch[item]
            if item in self.non_tensor_batch:
                return self.non_tensor_batch[item]
            raise KeyError(f"{item!r} is not in this DataProto; keys: {self.keys()}")
        if isinstance(item, (int, np.integer)):
            index = int(item)
            if not -len(self) <= index < len(self):
                raise IndexError(f"row {index} out of range for a DataProto of length {len(self)}")
            return self._take(slice(index % len(self), index % len(self) + 1))
        if isinstance(item, slice):
            return self._take(item)
        return self._take(self._as_index(item))

    def _as_index(self, item: Any) -> torch.Tensor:
        index = torch.as_tensor(np.asarray(item) if isinstance(item, (list, tuple)) else item)
        if index.dtype == torch.bool:
            if index.shape[0] != len(self):
                raise IndexError(f"boolean mask of length {index.shape[0]} for a DataProto of length {len(self)}")
            index = index.nonzero().flatten()
        return index.long().cpu()

    def _take(self, index: slice | torch.Tensor) -> "DataProto":
        if isinstance(index, slice):
            batch = {k: v[index] for k, v in self.batch.items()}
            non_tensor = {k: v[index] for k, v in self.non_tensor_batch.items()}
        else:
            batch = {k: v[index.to(v.device)] for k, v in self.batch.items()}
            non_tensor = {k: v[index.numpy()] for k, v in self.non_tensor_batch.items()}
        return DataProto(batch, non_tensor, self.meta_info)

    # -------------------------------------------------------------- selection
    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
    ) -> "DataProto":
        """A DataProto with only the named keys (None keeps all of that kind)."""
        batch = self._pick(self.batch, batch_keys, "batch")
        non_tensor = self._pick(self.non_tensor_batch, non_tensor_batch_keys, "non_tensor_batch")
        meta = self._pick(self.meta_info, meta_info_keys, "meta_info")
        return DataProto(batch, non_tensor, meta)

    @staticmethod
    def _pick(source: dict, keys: Sequence[str] | None, kind: str) -> dict:
        if keys is None:
            return dict(source)
        missing = [k for k in keys if k not in source]
        if missing:
            raise KeyError(f"{kind} has no keys {missing}; available: {sorted(source)}")
        return {k: source[k] for k in keys}

    def pop(
        self,
        batch_keys: Sequence[str] = (),
        non_tensor_batch_keys: Sequence[str] = (),
        meta_info_keys: Sequence[str] = (),
    ) -> "DataProto":
        """Remove the named keys from this DataProto and return them as a new one."""
        popped = self.select(list(batch_keys), list(non_tensor_batch_keys), list(meta_info_keys))
        for key in batch_keys:
            del self.batch[key]
        for key in non_tensor_batch_keys:
            del self.non_tensor_batch[key]
        for key in meta_info_keys:
            del self.meta_info[key]
        if not self.batch and not self.non_tensor_batch:
            self._size = 0
        return popped

    # ---------------------------------------------------------- split / join
    def chunk(self, chunks: int) -> list["DataProto"]:
        """Split into ``chunks`` equal parts; the length must divide."""
        if chunks <= 0:
            raise ValueError(f"chunk count must be positive, got {chunks}")
        if len(self) % chunks != 0:
            raise ValueError(
                f"cannot chunk a DataProto of length {len(self)} into {chunks} equal parts; "
                f"pad it first with pad_to_divisor({chunks}) and unpad the result"
            )
        return self.split(len(self) // chunks) if len(self) else [self._take(slice(0, 0)) for _ in range(chunks)]

    def split(self, split_size: int) -> list["DataProto"]:
        """Consecutive parts of ``split_size`` rows; the last one may be shorter."""
        if split_size <= 0:
            raise ValueError(f"split size must be positive, got {split_size}")
        return [self._take(slice(start, start + split_size)) for start in range(0, len(self), split_size)]

    @staticmethod
    def concat(parts: Sequence["DataProto"]) -> "DataProto":
        """Join along the batch dimension; meta_info is taken from the first part."""
        if not parts:
            raise ValueError("concat needs at least one DataProto")
        first = parts[0]
        for i, part in enumerate(parts[1:], start=1):
            if set(part.batch) != set(first.batch) or set(part.non_tensor_batch) != set(first.non_tensor_batch):
                raise ValueError(
                    f"concat: part {i} has keys {sorted(part.keys())}, part 0 has {sorted(first.keys())}"
                )
        batch = {k: torch.cat([p.batch[k] for p in parts]) for k in first.batch}
        non_tensor = {k: np.concatenate([p.non_tensor_batch[k] for p in parts]) for k in first.non_tensor_batch}
        return DataProto(batch, non_tensor, first.meta_info)

    def union(self, other: "DataProto") -> "DataProto":
        """All keys of both; a key present in both must hold equal values."""
        if self.keys() and other.keys() and len(self) != len(other):
            raise ValueError(f"union: batch sizes differ ({len(self)} vs {len(other)})")
        batch = dict(self.batch)
        for key, value in other.batch.items():
            if key in batch and not (batch[key].shape == value.shape and torch.equal(batch[key], value)):
                raise ValueError(f"union: tensor {key!r} differs between the two DataProtos")
            batch[key] = value
        non_tensor = dict(self.non_tensor_batch)
        for key, value in other.non_tensor_batch.items():
            if key in non_tensor and not np.array_equal(non_tensor[key], value):
                raise ValueError(f"union: non-tensor entry {key!r} differs between the two DataProtos")
            non_tensor[key] = value
        meta = dict(self.meta_info)
        for key, value in other.meta_info.items():
            if key in meta and not _same_value(meta[key], value):
                raise ValueError(f"union: meta_info {key!r} differs ({meta[key]!r} vs {value!r})")
            meta[key] = value
        return DataProto(batch, non_tensor, meta)

    def repeat(self, repeat_times: int, interleave: bool = True) -> "DataProto":
        """Each row ``repeat_times`` times: a a b b (interleave) or a b a b."""
        if repeat_times <= 0:
            raise ValueError(f"repeat_times must be positive, got {repeat_times}")
        if interleave:
            batch = {k: v.repeat_interleave(repeat_times, dim=0) for k, v in self.batch.items()}
            non_tensor = {k: np.repeat(v, repeat_times, axis=0) for k, v in self.non_tensor_batch.items()}
        else:
            batch = {k: v.repeat(repeat_times, *([1] * (v.dim() - 1))) for k, v in self.batch.items()}
            non_tensor = {k: np.concatenate([v] * repeat_times) for k, v in self.non_tensor_batch.items()}
        return DataProto(batch, non_tensor, self.meta_info)

    # ---------------------------------------------------------------- padding
    def pad_to_divisor(self, divisor: int) -> tuple["DataProto", int]:
        """Append rows (copies of the first rows, cyclically) so ``divisor`` divides the length.

        Returns the padded DataProto and the number of rows added; give that
        number to ``unpad`` on the result to drop the padding again.
        """
        if divisor <= 0:
            raise ValueError(f"divisor must be positive, got {divisor}")
        if len(self) == 0:
            raise ValueError("cannot pad an empty DataProto: there is no row to repeat")
        pad = (-len(self)) % divisor
        if pad == 0:
            return self, 0
        index = torch.arange(len(self) + pad) % len(self)
        return self._take(index), pad

    def unpad(self, pad_size: int) -> "DataProto":
        if pad_size < 0 or pad_size > len(self):
            raise ValueError(f"pad_size {pad_size} outside [0, {len(self)}]")
        return self if pad_size == 0 else self._take(slice(0, len(self) - pad_size))

    # --------------------------------------------------------------- iterate
    def make_iterator(
        self, mini_batch_size: int, epochs: int = 1, shuffle: bool = True, seed: int = 0
    ) -> Iterator["DataProto"]:
        """Mini-batches over ``epochs`` passes; each epoch shuffled with ``seed + epoch``.

        The length must divide by ``mini_batch_size`` so every update sees the
        same number of samples.
        """
        if mini_batch_size <= 0 or len(self) % mini_batch_size != 0:
            raise ValueError(
                f"mini_batch_size {mini_batch_size} must be positive and divide the batch size {len(self)}"
            )
        for epoch in range(epochs):
            if shuffle:
                generator = torch.Generator().manual_seed(seed + epoch)
                order = torch.randperm(len(self), generator=generator)
                epoch_data = self._take(order)
            else:
                epoch_data = self
            yield from epoch_data.split(mini_batch_size)

    def to(self, device: torch.device | str) -> "DataProto":
        return DataProto({k: v.to(device) for k, v in self.batch.items()}, self.non_tensor_batch, self.meta_info)

    # -------------------------------------------------------------- pickling
    def __reduce_ex__(self, protocol: int):
        specs, payloads = [], []
        for key, tensor in self.batch.items():
            flat = tensor.detach().cpu().contiguous().reshape(-1)
            raw = flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)
            specs.append((key, tuple(tensor.shape), tensor.dtype))
            # Protocol 5 hands the raw bytes to the pickler's buffer_callback
            # without serialising them; older protocols need plain bytes.
            payloads.append(pickle.PickleBuffer(raw) if protocol >= 5 else raw.tobytes())
        return _rebuild, (specs, payloads, self.non_tensor_batch, self.meta_info)


def _rebuild(specs, payloads, non_tensor_batch, meta_info) -> DataProto:
    batch = {}
    for (key, shape, dtype), payload in zip(specs, payloads):
        view = memoryview(payload)
        if view.nbytes == 0:
            batch[key] = torch.empty(shape, dtype=dtype)
            continue
        if isinstance(payload, bytes):
            # An in-band bytes object (pickle protocol < 5) is immutable: copy it.
            view = memoryview(bytearray(view))
        # Read-only memory here is a shared-memory store's (Ray's): the tensor is a zero-copy view of it.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            batch[key] = torch.frombuffer(view, dtype=torch.uint8).view(dtype).reshape(shape)
    return DataProto(batch, non_tensor_batch, meta_info)


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    try:
        return bool(a == b)
    except Exception:
        return a is b
