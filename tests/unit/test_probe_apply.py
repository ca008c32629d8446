"""Writing into storage views in place and rebuilding derived copies (``rollout_sync.rollout.apply``, ``rollout_sync.rollout.update``), with
plain CPU tensors standing for an engine's parameters (no vLLM)."""

from __future__ import annotations

import pytest
import torch

from rollout_sync.errors import IncompleteUpdateError, OutOfBoundsError, UnsupportedLayoutError
from rollout_sync.layout.box import Box
from rollout_sync.layout.maps import Piece, RankStorage
from rollout_sync.rollout.apply import (
    covered_ranges,
    storage_tensor,
    uncovered_ranges,
    write_pieces,
    write_segment,
)
from rollout_sync.rollout.storage_view import StorageView
from rollout_sync.rollout.update import DerivedCopy, UpdateSession


def test_a_storage_view_is_a_row_range_of_the_parameter_without_a_copy():
    qkv = torch.zeros(8, 4)
    k = storage_tensor(qkv, StorageView("qkv", 16, (2, 4)), tensor="k", rank=0)
    k.fill_(1)
    assert k.data_ptr() == qkv[4].data_ptr()
    assert qkv[4:6].eq(1).all() and qkv[:4].eq(0).all() and qkv[6:].eq(0).all()


def test_a_storage_view_refuses_a_strided_parameter_and_a_range_past_its_end():
    with pytest.raises(UnsupportedLayoutError, match="contiguous"):
        storage_tensor(torch.zeros(4, 8).t(), StorageView("w", 0, (8, 4)), tensor="w", rank=1)
    with pytest.raises(OutOfBoundsError) as err:
        storage_tensor(torch.zeros(4, 4), StorageView("w", 8, (3, 4)), tensor="w", rank=1)
    assert err.value.tensor == "w" and err.value.rank == 1


def test_write_pieces_copies_a_column_shard_and_a_transposed_piece():
    full = torch.arange(24.0).view(4, 6)
    # Row-parallel shard: columns 3:6 in a (4, 3) storage.
    shard = torch.zeros(4, 3)
    n = write_pieces(shard, RankStorage((4, 3), (Piece(Box((0, 3), (4, 3)), 0, (3, 1), (1,)),)), full)
    assert n == 12 and torch.equal(shard, full[:, 3:])
    # The whole tensor stored transposed.
    t = torch.zeros(6, 4)
    write_pieces(t, RankStorage((6, 4), (Piece(Box((0, 0), (4, 6)), 0, (1, 4), (0,)),)), full)
    assert torch.equal(t, full.t())


def test_write_segment_addresses_the_storage_view_not_the_parameter_start():
    param = torch.zeros(10)
    view = param[4:8]
    write_segment(view, 1, (1,), (2,), torch.tensor([5.0, 6.0]))
    assert param.tolist() == [0, 0, 0, 0, 0, 5, 6, 0, 0, 0]


def test_uncovered_ranges_are_the_gaps_between_storage_views():
    views = [StorageView("e", 0, (3, 2)), StorageView("e", 8, (1, 2)), StorageView("x", 0, (4,))]
    assert covered_ranges(views, "e") == [(0, 6), (8, 10)]
    assert uncovered_ranges(12, covered_ranges(views, "e")) == [(6, 8), (10, 12)]
    assert uncovered_ranges(4, covered_ranges(views, "x")) == []


def _session(derived, load_full=None):
    params = {"w13": torch.zeros(2, 4), "norm": torch.zeros(3)}
    views = {
        "gate": StorageView("w13", 0, (1, 4)),
        "up": StorageView("w13", 4, (1, 4)),
        "norm": StorageView("norm", 0, (3,)),
        "odd": StorageView(None, 0, (2, 2)),
    }
    dtypes = dict.fromkeys(views, "float32")
    return UpdateSession(7, views, dtypes, params, derived, load_full or (lambda staged: None)), params


def test_an_in_place_derived_copy_is_rebuilt_only_from_a_wholly_written_parameter():
    calls = []
    prepack = DerivedCopy("prepack", frozenset({"w13"}), lambda: calls.append("prepack"), True)
    session, params = _session([prepack])
    session.storage("gate").fill_(1)
    session.mark_written("gate")
    with pytest.raises(IncompleteUpdateError, match=r"did not write 1 of their tensors \(first: \['up'\]\)"):
        session.finish()
    assert calls == []
    session, params = _session([prepack])
    for name in ("gate", "up"):
        session.storage(name).fill_(2)
        session.mark_written(name)
    assert session.finish() == ["prepack"]
    assert calls == ["prepack"] and params["w13"].eq(2).all()


def test_a_derived_copy_of_an_untouched_parameter_is_left_alone():
    calls = []
    dense = DerivedCopy("dense", frozenset({"norm"}), lambda: calls.append("dense"), False)
    session, _ = _session([dense])
    session.storage("gate").fill_(1)
    session.mark_written("gate")
    assert session.finish() == [] and calls == []


def test_a_staged_tensor_is_loaded_whole_through_the_full_tensor_path_before_refreshes():
    order = []
    loaded = {}

    def load_full(staged):
        order.append("load")
        loaded.update({n: t.clone() for n, t in staged})

    derived = DerivedCopy("norm copy", frozenset({"norm"}), lambda: order.append("refresh"), False)
    session, _ = _session([derived], load_full)
    buf = session.storage("odd")
    assert buf.shape == (2, 2) and buf.dtype == torch.float32
    buf.copy_(torch.arange(4.0).view(2, 2))
    session.mark_written("odd")
    session.storage("norm").fill_(1)
    session.mark_written("norm")
    session.finish()
    assert order == ["load", "refresh"]
    assert torch.equal(loaded["odd"], torch.arange(4.0).view(2, 2))


def test_a_tensor_this_rank_does_not_hold_is_refused_by_name():
    session, _ = _session([])
    with pytest.raises(KeyError, match=r"rank 7 holds no storage of tensor 'lm_head\.weight'"):
        session.storage("lm_head.weight")


class _Layers:
    """Transient layers for the session: ``qkv`` (q and k land in it) is made at open, its content kept at
    close (standing for the engine's rebuild)."""

    def __init__(self, keeping: bool = False) -> None:
        self.events: list[str] = []
        self.rebuilt: dict[str, torch.Tensor] = {}
        self.keeping = keeping
        self.kept: set[str] = set()  # layers whose kept loaded form holds the last update's values

    def layer_of(self, param: str | None) -> str | None:
        return "attn.qkv" if param == "qkv" else None

    def open(self, layer: str):
        self.events.append(f"open {layer}")
        return {"qkv": torch.full((4, 4), -1.0)}

    def close(self, layer: str) -> None:
        self.events.append(f"close {layer}")

    def close_unchanged(self, layer: str) -> None:
        self.events.append(f"keep {layer}")

    def discard(self) -> list[str]:
        self.events.append("discard")
        return []

    def loaded_bytes(self, layer: str) -> int:
        return 64

    def kept_layer(self, layer: str) -> bool:
        return self.keeping and layer in self.kept

    def held_bytes(self) -> int:
        return 64 * (self.events.count("open attn.qkv") - self.events.count("close attn.qkv"))

    def adds_bytes(self, layer: str) -> int:
        return 64

    def room_bytes(self) -> int:
        return 128


def _transient_session(layers: _Layers, seen: list):
    views = {
        "q": StorageView("qkv", 0, (2, 4)),
        "k": StorageView("qkv", 8, (2, 4)),
        "norm": StorageView("n", 0, (3,)),
    }
    params = {"n": torch.zeros(3)}
    session = UpdateSession(
        3,
        views,
        dict.fromkeys(views, "float32"),
        params,
        [],
        lambda staged: None,
        layers,
        lambda layer, tensors: seen.append((layer, tensors["qkv"].clone())),
    )
    return session, params


def test_a_transient_layer_is_made_at_its_first_tensor_and_rebuilt_after_its_last():
    layers, seen = _Layers(), []
    session, params = _transient_session(layers, seen)
    assert session.streamed("q") and session.streamed("k") and not session.streamed("norm")
    placeholder = session.placeholder("q")
    assert placeholder.is_meta and placeholder.shape == (2, 4) and placeholder.dtype == torch.float32
    assert session.held_bytes() == 0 and session.adds_bytes("q") == 64 and session.adds_bytes("norm") == 0
    assert session.room_bytes() == 128
    session.storage("q").fill_(1)
    assert session.held_bytes() == 64 and session.adds_bytes("k") == 0  # k's layer is open already
    session.mark_written("q")
    assert layers.events == ["open attn.qkv"]  # k has not arrived: the layer stays open
    session.storage("k").fill_(2)
    session.storage("norm").fill_(5)
    session.mark_written("norm")
    session.mark_written("k")
    assert layers.events == ["open attn.qkv", "close attn.qkv"] and session.held_bytes() == 0
    ((layer, loaded),) = seen
    assert layer == "attn.qkv" and loaded[:2].eq(1).all() and loaded[2:].eq(2).all()
    assert session.finish() == ["loaded form of attn.qkv"]
    assert params["n"].eq(5).all()


def test_a_transient_layer_written_in_part_is_dropped_and_the_update_refused():
    layers, seen = _Layers(), []
    session, _ = _transient_session(layers, seen)
    session.storage("q").fill_(1)
    session.mark_written("q")
    with pytest.raises(IncompleteUpdateError, match=r"attn\.qkv.*\['k'\]"):
        session.finish()
    assert layers.events == ["open attn.qkv", "discard"] and seen == []


def test_kept_loaded_forms_are_written_like_storage_and_hold_the_base_only_once_written():
    layers, seen = _Layers(keeping=True), []
    session, _ = _transient_session(layers, seen)
    # Kept loaded forms are real storage (no placeholder, no streaming window) ...
    assert not session.streamed("q") and not session.streamed("k")
    assert session.held_bytes() == 0 and session.adds_bytes("q") == 0 and session.room_bytes() == 0
    # ... but they hold no base before an update has written them: a delta sync cannot apply yet.
    assert not session.persistent("q") and session.persistent("norm")
    layers.kept.add("attn.qkv")
    assert session.persistent("q") and session.persistent("k")
    session.storage("q").fill_(1)
    assert session.held_bytes() == 0  # kept, not transient
    session.mark_written("q")
    session.storage("k").fill_(2)
    session.mark_written("k")
    assert layers.events == ["open attn.qkv", "close attn.qkv"]  # rebuilt once complete, as when streamed
    assert [layer for layer, _ in seen] == ["attn.qkv"]


def test_a_kept_layer_that_arrived_unchanged_is_closed_without_a_rebuild():
    layers, seen = _Layers(keeping=True), []
    layers.kept.add("attn.qkv")
    session, _ = _transient_session(layers, seen)
    for name in ("q", "k", "norm"):
        session.storage(name)
    session.mark_unchanged("q")
    assert layers.events == ["open attn.qkv"]  # k has not arrived yet
    session.mark_unchanged("k")
    session.mark_unchanged("norm")
    assert layers.events == ["open attn.qkv", "keep attn.qkv"] and seen == []
    assert session.finish() == []


def test_a_kept_layer_with_one_changed_tensor_is_rebuilt_and_derived_copies_follow_changes_only():
    layers, seen = _Layers(keeping=True), []
    layers.kept.add("attn.qkv")
    session, _ = _transient_session(layers, seen)
    refreshed: list[str] = []
    session.derived = [DerivedCopy("norm copy", frozenset({"n"}), lambda: refreshed.append("norm"), False)]
    session.storage("q").fill_(1)
    session.storage("k")
    session.mark_written("q")
    session.mark_unchanged("k")
    session.mark_unchanged("norm")
    assert layers.events == ["open attn.qkv", "close attn.qkv"] and [layer for layer, _ in seen] == [
        "attn.qkv"
    ]
    assert session.finish() == ["loaded form of attn.qkv"] and refreshed == []


def test_only_storage_that_outlives_updates_can_arrive_unchanged():
    layers, seen = _Layers(keeping=False), []
    session, _ = _transient_session(layers, seen)
    with pytest.raises(IncompleteUpdateError, match=r"tensor 'q' cannot be unchanged"):
        session.mark_unchanged("q")  # a streamed loaded form is made anew at each update
    plain, _ = _session([])
    with pytest.raises(IncompleteUpdateError, match=r"tensor 'odd' cannot be unchanged"):
        plain.mark_unchanged("odd")  # a staging buffer
    prepack = DerivedCopy("prepack", frozenset({"w13"}), lambda: None, True)
    packed, _ = _session([prepack])
    assert not packed.persistent("gate")  # the parameter holds the prepacked layout between updates
    with pytest.raises(IncompleteUpdateError, match=r"tensor 'gate' cannot be unchanged"):
        packed.mark_unchanged("gate")
    with pytest.raises(KeyError):
        plain.mark_unchanged("lm_head.weight")


def test_an_atomic_update_writes_nothing_until_it_finishes_and_an_aborted_one_nothing_at_all():
    layers, seen = _Layers(), []
    session, params = _transient_session(layers, seen)
    session.atomic = True
    assert not session.streamed("q")  # every layer stays open until finish: no streaming window
    for name, value in (("q", 1.0), ("k", 2.0), ("norm", 5.0)):
        session.storage(name).fill_(value)
        session.mark_written(name)
    assert params["n"].eq(0).all(), "a parameter changed before the update finished"
    assert layers.events == ["open attn.qkv"] and seen == [], "a layer was rebuilt before the update finished"
    assert session.finish() == ["loaded form of attn.qkv"]
    assert params["n"].eq(5).all() and layers.events == ["open attn.qkv", "close attn.qkv"]
    ((_, loaded),) = seen
    assert loaded[:2].eq(1).all() and loaded[2:].eq(2).all()

    layers, seen = _Layers(), []
    failed, params = _transient_session(layers, seen)
    failed.atomic = True
    for name in ("q", "k", "norm"):
        failed.storage(name).fill_(9)
        failed.mark_written(name)
    failed.abort()  # the sync failed after every byte had landed, at the commit
    assert params["n"].eq(0).all() and layers.events == ["open attn.qkv", "discard"] and seen == []


def test_an_atomic_delta_applies_on_the_values_the_storage_holds():
    layers, seen = _Layers(keeping=True), []
    layers.kept.add("attn.qkv")
    session, params = _transient_session(layers, seen)
    session.atomic = True
    params["n"].copy_(torch.tensor([1.0, 2.0, 3.0]))
    copy = session.storage("norm")
    assert copy.data_ptr() != params["n"].data_ptr() and copy.tolist() == [1.0, 2.0, 3.0]
    copy[1] = 7.0  # a sparse delta
    session.mark_written("norm")
    assert params["n"].tolist() == [1.0, 2.0, 3.0]
    session.finish()
    assert params["n"].tolist() == [1.0, 7.0, 3.0]
