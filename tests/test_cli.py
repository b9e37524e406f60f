"""Command-line tests, one section per subcommand."""
import json

from pitgen.cli import main

CONV = "O[n,f,y,x] += I[n,c,y+r,x+s] * W[f,c,r,s]"


# -- pitgen rules ----------------------------------------------------------------------------------

def rules_json(capsys, expr: str) -> dict:
    assert main(["rules", expr, "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return json.loads(out)


def test_rules_json_schema(capsys):
    doc = rules_json(capsys, "C[m,n] += A[m,k] * B[k,n]")
    assert set(doc) == {"expression", "axes"}
    assert doc["expression"] == "C[m,n] += A[m,k] * B[k,n]"
    assert list(doc["axes"]) == ["m", "n", "k"]
    for rule in doc["axes"].values():
        assert set(rule) == {"role", "invariant", "needs", "reason"}
        assert rule["role"] in ("spatial", "reduction")
        assert isinstance(rule["invariant"], bool) and isinstance(rule["reason"], str)
        assert set(rule["needs"]) <= {"SRead", "SWrite"}
    assert doc["axes"]["m"]["needs"] == ["SRead", "SWrite"]
    assert (doc["axes"]["k"]["role"], doc["axes"]["k"]["needs"]) == ("reduction", ["SRead"])


def test_rules_json_conv(capsys):
    axes = rules_json(capsys, CONV)["axes"]
    assert {a: r["invariant"] for a, r in axes.items()} == {
        "n": True, "f": True, "y": False, "x": False, "c": True, "r": False, "s": False}
    assert axes["y"]["needs"] == [] and "coupled to r" in axes["y"]["reason"]


def test_rules_explain_by_default(capsys):
    assert main(["rules", CONV]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"PIT rules for {CONV}\n")
    assert "y: spatial axis, NOT invariant" in out and "symbolic check:" in out


def test_rules_bad_expression_exits_2(capsys):
    assert main(["rules", "C[m,n] += relu(A[m,k] * B[k,n])", "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("pitgen: error: relu(...) under '+=' is not a valid sum")
    assert "(column 11)" in err
