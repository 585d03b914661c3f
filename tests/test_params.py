"""common/params.py: every exercise declares its parameters, and a bad value is refused in one line."""
import json

import pytest

from common.errors import LabError
from common.params import Bool, Choice, Float, Folder, Int, ParamError, Record
from common.registry import all_exercises


# ------------------------------------------------------------------------------ every exercise
@pytest.mark.parametrize("ex", all_exercises(), ids=lambda e: e.id)
def test_every_parameter_is_declared_and_every_default_is_allowed(ex):
    assert set(ex.schema) == set(ex.params)
    for on_cpu in (False, True):
        for quick in (False, True):
            ex.resolve_params(on_cpu, quick, {})          # raises on a default outside its declaration
    for name, spec in ex.schema.items():
        assert spec.allowed(), name                       # says in words what is allowed


@pytest.mark.parametrize("ex", all_exercises(), ids=lambda e: e.id)
def test_declarations_leave_every_default_exactly_as_it_was(ex):
    """Checking must not change a value a record would store (300 stays 300, not 300.0)."""
    for on_cpu in (False, True):
        for quick in (False, True):
            raw = {**ex.params, **(ex.cpu_params if on_cpu else {}), **(ex.quick_params if quick else {})}
            got = ex.resolve_params(on_cpu, quick, {})
            assert json.dumps(got, sort_keys=True) == json.dumps(raw, sort_keys=True)


@pytest.mark.parametrize("ex", [e for e in all_exercises() if e.schema], ids=lambda e: e.id)
def test_every_exercise_with_sizes_predicts_its_memory(ex):
    assert ex.footprint_bytes is not None, f"{ex.id} declares parameters but no footprint_bytes"
    for on_cpu in (False, True):
        need = ex.footprint_bytes(ex.resolve_params(on_cpu, False, {}))
        assert need > 0


# ------------------------------------------------------------------------------ the checks
def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and isinstance(exc.value, LabError) and exc.value.exit_code == 2
    return msg


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "x", None, [4, -5], []])
def test_bad_sizes_are_refused_naming_parameter_value_and_range(value):
    sizes = Int([1024], min=1, unit="elements", many=True)
    with pytest.raises(ParamError) as exc:
        sizes.check("sizes", value)
    msg = one_line(exc)
    assert msg.startswith("--param sizes=") and ">= 1" in msg and "elements" in msg


def test_a_single_value_of_a_list_parameter_is_a_list_of_one():
    assert Int([1], min=1, many=True).check("sizes", 1024) == [1024]
    assert Int([1], min=1, many=True).check("sizes", 2048.0) == [2048]


def test_choices_ranges_and_literals():
    dtype = Choice("fp16", ("fp16", "bf16"))
    with pytest.raises(ParamError, match=r"dtype=fp99: must be one of fp16, bf16"):
        dtype.check("dtype", "fp99")
    world = Int("auto", min=2, many=True, also=("auto",))
    assert world.check("world_sizes", "auto") == "auto" and world.check("world_sizes", [2, 4]) == [2, 4]
    with pytest.raises(ParamError, match=r"world_sizes=\[1\].*>= 2.*'auto'"):
        world.check("world_sizes", [1])
    with pytest.raises(ParamError, match=r"world_sizes=\[auto\]"):      # 'auto' replaces the list
        world.check("world_sizes", ["auto"])
    channels = Int([None, 16], min=1, max=64, many=True, nullable=True)
    assert channels.check("c", [None, 16]) == [None, 16] and channels.check("c", None) == [None]
    with pytest.raises(ParamError):
        channels.check("c", [None, 65])
    assert Float(0.5, min=0, max=1).check("t", 1) == 1 and Float([5], many=True).check("cap", [5]) == [5]
    with pytest.raises(ParamError):
        Float(0.5, min=0, max=1).check("t", float("nan"))
    with pytest.raises(ParamError):
        Bool(False).check("compile", 1)


def test_fixed_length_shapes():
    shape = Int([1000, 777, 555], min=1, length=3)
    assert shape.check("irregular_shape", [3, 5, 7]) == [3, 5, 7]
    with pytest.raises(ParamError, match="a list of 3 values"):
        shape.check("irregular_shape", [3, 5])


def test_lists_of_shapes_and_rules_across_values():
    shapes = Int([[2, 3]], min=1, length=2, many=True, rule=lambda s: "too big" if s[0] * s[1] > 100 else None)
    assert shapes.check("shapes", [[4, 5], [6, 7]]) == [[4, 5], [6, 7]]
    assert shapes.check("shapes", [4, 5]) == [[4, 5]]                  # one shape alone: a list of one
    with pytest.raises(ParamError, match="a list of shapes, each a list of 2 values"):
        shapes.check("shapes", [[4, 5, 6]])
    with pytest.raises(ParamError, match=r"shapes=\[\[4,5\],\[20,20\]\]: too big"):
        shapes.check("shapes", [[4, 5], [20, 20]])
    from phases.phase7_gpt.model import Shape
    with pytest.raises(ParamError, match="n_embd 64 is not a multiple of n_head 3"):
        Shape({"n_layer": 1, "n_head": 1, "n_embd": 8}).check("model", {"n_layer": 2, "n_head": 3, "n_embd": 64})


def test_records_with_declared_keys():
    shape = Record({"n_layer": 2, "n_embd": 8}, {"n_layer": Int(None, min=1), "n_embd": Int(None, min=1)})
    assert shape.check("model", {"n_layer": 3, "n_embd": 16}) == {"n_layer": 3, "n_embd": 16}
    with pytest.raises(ParamError, match="unknown key 'n_layers'"):
        shape.check("model", {"n_layers": 3, "n_embd": 16})
    with pytest.raises(ParamError, match="missing key 'n_embd'"):
        shape.check("model", {"n_layer": 3})
    with pytest.raises(ParamError, match=r"model.n_layer=0"):
        shape.check("model", {"n_layer": 0, "n_embd": 16})


def test_folders_must_exist_and_are_recorded_without_absolute_paths(tmp_path):
    folder = Folder(None)
    with pytest.raises(ParamError, match="no such folder"):
        folder.check("data_dir", str(tmp_path / "nowhere"))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "a.txt").write_text("hello")
    assert folder.check("data_dir", str(tmp_path / "mine")) == str(tmp_path / "mine")
    recorded = folder.recorded(str(tmp_path / "mine"))
    assert recorded.startswith("mine@sha256:") and str(tmp_path) not in recorded
    (tmp_path / "mine" / "a.txt").write_text("changed")
    assert folder.recorded(str(tmp_path / "mine")) != recorded          # the hash follows the content
    from common.paths import REPO_ROOT
    assert folder.recorded(str(REPO_ROOT / "data")) == "data"            # inside the repo: relative


def test_an_undeclared_parameter_is_a_programming_error():
    from common.exercise import Exercise
    with pytest.raises(TypeError, match="not declared"):
        Exercise(id="phase9.bad", title="t", run=None, params={"n": 4})
    with pytest.raises(TypeError, match="undeclared 'm'"):
        Exercise(id="phase9.bad", title="t", run=None, params={"n": Int(4, min=1)}, cpu_params={"m": 1})


ODD_VALUES = (None, 0, 1, 2, 10**15, "x", [], [None], ["auto"], [0], [1], [10**15], {"a": 1}, True, 1.5, -1, [[1, 1]])


@pytest.mark.parametrize("ex", all_exercises(), ids=lambda e: e.id)
def test_odd_values_are_refused_or_run_never_crash_the_checks(ex):
    """Whatever a user types, checking it and predicting its memory ends in a value or a one-line
    LabError, never an internal error (world_sizes=[auto] once crashed the footprint)."""
    for name in ex.schema:
        for value in ODD_VALUES:
            for on_cpu in (False, True):
                try:
                    params = ex.resolve_params(on_cpu, False, {name: value})
                    if ex.footprint_bytes is not None:
                        assert ex.footprint_bytes(params) >= 0
                except LabError as exc:
                    assert "\n" not in str(exc)
