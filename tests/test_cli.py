"""`ddtree generate` as a user runs it: JSON output, the model's sampling defaults, one-line errors.

Most tests call the command's `main` in this process, as the `ddtree` script does. A subprocess pays for
importing torch and transformers again, about 9 s on a 2-core CI machine, so only the tests of what a real
process shows (its JSON on stdout, an error without a traceback) start one.
"""

import json
import subprocess
import sys

import pytest
from ddtree.cli import main


def run(*args: str) -> subprocess.CompletedProcess:
    """`ddtree generate` in a real process."""
    return subprocess.run([sys.executable, "-m", "ddtree.cli", "generate", *args], capture_output=True, text=True,
                          timeout=300)


def generate(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """`ddtree generate` in this process: exit code, stdout, stderr."""
    capsys.readouterr()
    code = main(["generate", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json_for_each_method_gives_the_same_tokens(ckpt, capsys):
    pair = ("--target", str(ckpt / "qwen3"), "--draft", str(ckpt / "draft"), "--prompt-ids", "1,2,3",
            "--max-new-tokens", "20", "--device", "cpu", "--json")
    outputs = {}
    for method in ("ar", "dflash", "ddtree"):
        if method == "ddtree":  # one real process: its stdout is the JSON document alone
            proc = run(*pair, "--method", method, "--budget", "8")
            code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        else:
            code, stdout, stderr = generate(capsys, *pair, "--method", method, "--budget", "8")
        assert code == 0, stderr
        out = json.loads(stdout)
        assert set(out) == {"text", "token_ids", "finish_reason", "stats"}
        assert out["stats"]["method"] == method
        assert out["stats"]["generated_tokens"] == len(out["token_ids"]) <= 20
        for key in ("budget", "rounds", "acceptance_length", "decode_seconds", "tokens_per_second",
                    "accepted_per_depth", "phase_seconds"):
            assert key in out["stats"]
        outputs[method] = out["token_ids"]
    assert outputs["ar"] == outputs["dflash"] == outputs["ddtree"]
    penalized = {}
    for method in ("ar", "ddtree"):
        code, stdout, _ = generate(capsys, *pair, "--method", method, "--repetition-penalty", "1.8",
                                   "--frequency-penalty", "0.5")
        penalized[method] = json.loads(stdout)["token_ids"]
    assert penalized["ar"] == penalized["ddtree"] != outputs["ar"]


@pytest.mark.parametrize("args,message", [
    (["--target", "/nonexistent", "--prompt-ids", "1"], "target directory /nonexistent does not exist"),
    (["--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers"),
    (["--prompt-ids", "1", "--temperature", "-1"], "temperature must be >= 0"),
    (["--prompt-ids", "1", "--repetition-penalty", "0"], "repetition_penalty must be > 0"),
    (["--prompt-ids", "1", "--method", "ddtree", "--budget", "-2"], "budget must be >= 0"),
    (["--prompt-ids", "1", "--json-schema", '{"type": "objectx"}'], "unsupported JSON schema: Invalid type: objectx"),
    (["--prompt-ids", "1", "--json-schema", "/nonexistent.json"], "--json-schema: cannot read /nonexistent.json"),
    (["--prompt-ids", "1", "--regex", "(a"], "unclosed group"),
    (["--prompt-ids", "1", "--choice", "yes"], "structured outputs need the model's tokenizer"),
])
def test_user_errors_are_one_line_without_traceback(ckpt, args, message, capsys):
    if "--target" not in args:
        args = ["--target", str(ckpt / "qwen3"), "--draft", str(ckpt / "draft"), *args]
    code, _, stderr = generate(capsys, *args, "--device", "cpu")  # an exception here would fail the test
    assert code == 2
    errors = [line for line in stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0]


def test_a_user_error_in_a_real_process_is_one_line_without_traceback(ckpt):
    proc = run("--target", str(ckpt / "qwen3"), "--draft", str(ckpt / "draft"), "--prompt-ids", "1", "--temperature",
               "-1", "--device", "cpu")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == ["ddtree generate: error: temperature must be >= 0"]


def test_mismatched_pair_is_refused(ckpt, tmp_path, capsys):
    from tiny import make_draft

    make_draft(tmp_path / "wide", target_layers=6, taps=[1, 2])
    code, _, stderr = generate(capsys, "--target", str(ckpt / "qwen3"), "--draft", str(tmp_path / "wide"),
                               "--prompt-ids", "1", "--device", "cpu")
    assert code == 2 and "trained for a 6-layer target" in stderr


def test_generate_constrained_by_a_schema_file_a_regex_or_choices(tmp_path, capsys):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}))
    base = ("--prompt", "Is the build green?", "--chat", "--device", "cpu", "--json", "--max-new-tokens", "40")

    def reply(*args: str) -> dict:
        code, stdout, stderr = generate(capsys, *base, *args)
        assert code == 0, stderr
        return json.loads(stdout)

    out = reply("--json-schema", str(schema))
    assert set(json.loads(out["text"])) == {"ok"} and out["finish_reason"] == "stop"
    out = reply("--regex", "[0-9]{4}")
    assert len(out["text"]) == 4 and out["text"].isdigit()
    out = reply("--choice", "yes", "--choice", "no", "--temperature", "1", "--seed", "3")
    assert out["text"] in ("yes", "no")
    schema.write_text("[]")  # JSON, but no schema: refused rather than taken as "any object"
    code, _, stderr = generate(capsys, *base, "--json-schema", str(schema))
    assert code == 2 and "the JSON schema must be an object" in stderr


def test_generate_takes_the_models_sampling_defaults_for_flags_not_given(ckpt, tmp_path, capsys):
    from tiny import make_target

    target = make_target(tmp_path / "sampled", generation_config={"do_sample": True, "temperature": 1.5, "top_k": 8})
    base = ("--target", str(target), "--draft", str(ckpt / "draft"), "--prompt-ids", "1,2,3", "--max-new-tokens",
            "24", "--device", "cpu", "--json", "--seed", "5")

    def tokens(*args: str) -> tuple[list[int], str]:
        code, stdout, stderr = generate(capsys, *base, *args)
        assert code == 0, stderr
        return json.loads(stdout)["token_ids"], stderr

    auto, err = tokens()
    assert "sampling defaults from the model's generation_config.json: temperature=1.5, top_k=8" in err
    assert tokens("--temperature", "1.5", "--top-k", "8")[0] == auto  # the same draws as the flags themselves
    greedy, err = tokens("--generation-config", "none")
    assert "generation_config.json" not in err
    assert tokens("--temperature", "0")[0] == greedy != auto  # a flag given wins over the file
