"""What training_step reads of its batch, from its source (l2lightning.guards.batch_reads), and the batch
signature that leaves the unread parts' values out."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
from lightning.pytorch import LightningModule

from l2lightning.graph.capture import StaticBatch, flatten_batch, signature_of, without_unread_values
from l2lightning.guards.batch_reads import BatchReads, batch_reads

Sample = namedtuple("Sample", ["x", "y", "path"])


@dataclass
class Record:
    x: torch.Tensor
    path: str

    def moved(self):
        return self


def log_value(*values):
    return values


class Unpacks(LightningModule):
    def training_step(self, batch, batch_idx):
        x, y, paths = batch
        return (x - y).sum()


class UnpacksUnderscore(LightningModule):
    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return (x - y).sum()


class UnpacksStarred(LightningModule):
    def training_step(self, batch, batch_idx):
        x, y, *_ = batch
        return (x - y).sum()


class ReadsKeys(LightningModule):
    def training_step(self, batch, batch_idx):
        return (batch["x"] - batch["y"]).sum()


class ReadsLast(LightningModule):
    def training_step(self, batch, batch_idx):
        return batch[0].sum() + batch[-1].sum()


class ThroughAHelper(LightningModule):
    """lightning-hydra-template's shape: the step hands the batch to a method of the module."""

    def model_step(self, batch):
        x, y, meta = batch
        return (x - y).sum()

    def training_step(self, batch, batch_idx):
        return self.model_step(batch)


class Base(LightningModule):
    def training_step(self, batch, batch_idx):
        return batch.x.sum()


class ThroughSuper(Base):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + batch.y.sum()


class UsesTheNames(LightningModule):
    def training_step(self, batch, batch_idx):
        x, y, paths = batch
        loss = (x - y).sum()
        return loss * 2 if paths[0].endswith("7") else loss


class InALambda(LightningModule):
    def training_step(self, batch, batch_idx):
        pick = lambda: batch[2]  # noqa: E731
        return batch[0].sum() + pick().sum()


class ItemsMethod(LightningModule):
    def training_step(self, batch, batch_idx):
        return sum(v.sum() for k, v in batch.items() if k != "path")


class DataclassMethod(LightningModule):
    def training_step(self, batch, batch_idx):
        return batch.moved().x.sum()


def decorated(fn):
    return fn


class Decorated(LightningModule):
    @decorated
    def training_step(self, batch, batch_idx):
        x, y, paths = batch
        return (x - y).sum()


class StarArgs(LightningModule):
    def training_step(self, *args):
        x, y, paths = args[0]
        return (x - y).sum()


class ExplicitSuper(Base):
    def training_step(self, batch, batch_idx):
        return super(Base, self).training_step(batch, batch_idx)


class HelperReplacedOnTheInstance(ThroughAHelper):
    def __init__(self):
        super().__init__()
        self.model_step = lambda batch: batch[2]


ESCAPES = {
    "stored": "self.last = batch",
    "len": "n = len(batch)",
    "iterated": "n = [t for t in batch]",
    "free function": "n = log_value(batch)",
    "computed index": "n = batch[batch_idx % 2]",
    "slice": "n = batch[:2]",
    "rebound": "other = batch",
    "returned in a dict": "n = {'b': batch}",
    "locals": "n = locals()",
    "forward": "n = self(batch)",
}


def escaping(line, path):
    """A module whose step uses its batch with `line` first; its source in the file `path` (one per
    test: inspect.getsource reads it through linecache, which would keep an earlier file's lines)."""
    namespace = {"LightningModule": LightningModule, "log_value": log_value}
    source = (
        "class Escapes(LightningModule):\n"
        "    def training_step(self, batch, batch_idx):\n"
        f"        {line}\n"
        "        x, y, paths = batch\n"
        "        return (x - y).sum()\n"
    )
    path.write_text(source)
    exec(compile(source, str(path), "exec"), namespace)
    return namespace["Escapes"]


def t(*shape):
    return torch.zeros(*shape)


@pytest.mark.parametrize(
    ("cls", "batch", "unread"),
    [
        (Unpacks, (t(2), t(2), ["a", "b"]), {2}),
        (UnpacksUnderscore, [t(2), t(2), 7], {2}),
        (UnpacksStarred, (t(2), t(2), "p", 3), {2, 3}),
        (ReadsKeys, {"x": t(2), "y": t(2), "path": "p", "id": 4}, {"path", "id"}),
        (ReadsLast, (t(2), "p", t(2)), {1}),
        (ThroughAHelper, (t(2), t(2), {"id": 3}), {2}),
        (ThroughSuper, Sample(t(2), t(2), "p"), {2}),
        (UsesTheNames, (t(2), t(2), ["a"]), set()),
        (InALambda, (t(2), "p", t(2)), {1}),
        (ItemsMethod, {"x": t(2), "path": "p"}, set()),
        (DataclassMethod, Record(t(2), "p"), set()),
        (Decorated, (t(2), t(2), ["a"]), set()),
        (StarArgs, (t(2), t(2), ["a"]), set()),
        (ExplicitSuper, Sample(t(2), t(2), "p"), set()),
        (HelperReplacedOnTheInstance, (t(2), t(2), {"id": 3}), set()),
    ],
)
def test_the_parts_a_step_never_reads(cls, batch, unread):
    assert batch_reads(cls()).unread_parts(batch) == unread


@pytest.mark.parametrize("line", list(ESCAPES.values()), ids=list(ESCAPES))
def test_a_batch_that_escapes_where_the_reading_cannot_follow_counts_as_read_everywhere(line, tmp_path):
    reads = batch_reads(escaping(line, tmp_path / "escapes.py")())
    assert reads.everything and reads.unread_parts((t(2), t(2), ["a"])) == frozenset()


def test_a_mapping_taken_by_position_counts_as_read_everywhere():
    # `a, b = batch` on a dict binds its keys; a Mapping that iterates otherwise could bind values
    reads = batch_reads(UnpacksUnderscore())
    assert reads.unread_parts({"x": t(2), "y": t(2), "path": "p"}) == frozenset()


def test_attributes_of_a_plain_tuple_or_dict_read_every_part():
    # `batch.count(...)`, `batch.get("x")`: methods of the container, which can reach any part
    reads = BatchReads(items=frozenset({0}), attributes=frozenset({"get"}), everything=False)
    assert reads.unread_parts((t(2), "p")) == frozenset()
    assert reads.unread_parts({"x": t(2), "p": 1}) == frozenset()
    assert reads.unread_parts(Sample(t(2), t(2), "p")) == frozenset()  # not a field


def test_the_signature_leaves_out_unread_values_only():
    reads = batch_reads(Unpacks())
    a = (t(2), t(2), ["a.png", "b.png"])
    b = (t(2), t(2), ["c.png", "d.png"])
    static = StaticBatch(a, reads)
    assert static.mismatch(b) is None  # other names in an unread part: the same graph
    static.copy_in(b)
    assert static.mismatch((t(2), t(2), ["c.png"])) is not None  # the list's length is structure
    assert static.mismatch((t(3), t(2), ["c.png", "d.png"])) is not None  # shapes are compared
    read_everywhere = StaticBatch(a)
    assert read_everywhere.mismatch(b) is not None
    spec = flatten_batch(b)[1]
    assert without_unread_values(spec, frozenset()) is spec
    # values elsewhere in the batch are still compared
    keys = batch_reads(ReadsKeys())
    one = {"x": t(2), "y": t(2), "path": "p", "id": 4}
    static = StaticBatch(one, keys)
    assert static.mismatch({**one, "path": "q", "id": 5}) is None
    tensors, spec = flatten_batch({**one, "y": 1.5})
    assert signature_of(tensors, spec) != static.signature


def test_the_answer_is_kept_per_batch_layout_and_not_shared_across_layouts():
    keys = batch_reads(ReadsKeys())
    assert keys.unread_parts({"x": t(2), "y": t(2), "path": "p"}) == {"path"}
    assert keys.unread_parts({"x": t(2), "y": t(2), "id": 3}) == {"id"}
    assert keys.unread_parts({"x": t(2), "y": t(2), "path": "q"}) == {"path"}
    starred = batch_reads(UnpacksStarred())
    assert starred.unread_parts((t(2), t(2), "p")) == {2}
    assert starred.unread_parts((t(2), t(2), "p", 4)) == {2, 3}
    assert starred.unread_parts([t(2), t(2), "p"]) == {2}
