"""specdec.training.token_map: the target's own answers make a draft vocabulary that --draft-vocab loads."""

from __future__ import annotations

import torch

from specdec.engine.draft_vocab_head import vocabulary_ids
from specdec.training.token_map import main


def test_a_map_of_the_target_answers_loads_as_a_draft_vocabulary(tiny_target, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hello.\n\nName three colours.\n")
    for name in ("map.pt", "map.txt"):
        out = tmp_path / name
        assert main(["--target", tiny_target, "--out", str(out), "--size", "100", "--prompts", str(prompts),
                     "--max-new-tokens", "6"]) == 0
        said = capsys.readouterr().out
        assert f"wrote 100 token ids to {out}: 1.000 of the 12 answer tokens of 2 prompts" in said, said
        ids = vocabulary_ids(str(out), 49152, [2])
        assert ids is not None and 100 <= ids.numel() <= 101  # the map, and the end token if it was not in it
    assert torch.equal(torch.load(tmp_path / "map.pt"), torch.tensor(
        [int(x) for x in (tmp_path / "map.txt").read_text().split()]))
