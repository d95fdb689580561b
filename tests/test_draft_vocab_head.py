"""A draft's LM head over its draft vocabulary (specdec.engine.draft_vocab_head; the draft tier's --draft-vocab).

Exact cases: which ids a setting names (N lowest ids with the EOS ones, a file in each form, what is refused and
why); the restricted head's logits are bitwise the full head's on the draft vocabulary (float32 and Q8_0, on the
packed step's kernel and off it, a prefix of ids and scattered ids) and FLOOR elsewhere; the target refuses the
setting. The law: the tiny model as its own draft, its draft vocabulary leaving out the target's most likely token,
proposes only inside it, and the target's rejection sampler still gives the first token exactly p (chi-square),
that token included. End to end through real servers: greedy output is the target's own with a restricted draft.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch
from scipy.stats import chisquare

from specdec.client import Client
from specdec.engine.config import StepConfig, TierConfig
from specdec.engine.draft_vocab_head import FLOOR, DraftVocabHead, restrict_head, vocabulary_ids
from specdec.engine.draft_probs import DraftProbs
from specdec.engine.engine import Engine
from specdec.engine.tier_model import load_tier_model
from specdec.engine.kv_cache import KVGeometry, SlotKVCache
from specdec.engine.propose import ProposeWork
from specdec.engine.runner import Feed, ModelRunner
from specdec.engine.step import resolve_mode
from specdec.engine.verify import VerifyWork, _verify_sampled
from specdec.math.params import SamplingParams
from specdec.models import ModelConfig, load_model
from tests.helpers import Cluster, child_env, device_model, needs_cpu_kernels, reference_greedy
from tests.step_modes import MODES, make_runner
from tests.test_draft_chain import GREEDY, NUCLEUS, WARM, chain_against_steps

PROMPT = [1, 504, 3937, 282, 4193, 314, 30, 2600, 28, 540, 29, 15, 216]


def test_a_number_names_the_lowest_ids_and_the_end_tokens():
    assert torch.equal(vocabulary_ids("4", 100, [2, 90]), torch.tensor([0, 1, 2, 3, 90]))
    assert vocabulary_ids("0", 100, [2]) is None  # the whole vocabulary
    assert vocabulary_ids("100", 100, [2]) is None and vocabulary_ids("5000", 100, [2]) is None
    assert torch.equal(vocabulary_ids("auto", 49152, [2]), torch.arange(16384))  # the default pair's: a third
    assert vocabulary_ids("auto", 32768, [2]) is None  # a vocabulary this small stays whole


def test_a_file_names_its_ids_in_each_form(tmp_path):
    want = torch.tensor([2, 5, 7, 40])
    forms = {"ids.txt": "7 5\n40", "ids.csv": "5,7,40", "ids.json": "[40, 7, 5, 7]"}
    for name, text in forms.items():
        (tmp_path / name).write_text(text)
        assert torch.equal(vocabulary_ids(str(tmp_path / name), 100, [2]), want), name
    torch.save(torch.tensor([40, 5, 7], dtype=torch.int32), tmp_path / "map.pt")  # SGLang's token map: a tensor
    assert torch.equal(vocabulary_ids(str(tmp_path / "map.pt"), 100, [2]), want)


@pytest.mark.parametrize("text, message", [
    ("1 2 300", "token id 300 is outside the draft's vocabulary [0, 100)"),
    ("", "the file holds no token ids"),
    ("1 two 3", "expected token ids (integers)"),
])
def test_a_bad_file_is_refused_with_what_is_wrong(tmp_path, text, message):
    (tmp_path / "ids.txt").write_text(text)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        vocabulary_ids(str(tmp_path / "ids.txt"), 100, [2])
    with pytest.raises(ValueError, match="neither a number of tokens nor a file"):
        vocabulary_ids(str(tmp_path / "missing.txt"), 100, [2])


def logits(model, step: StepConfig, ids: list[int]) -> torch.Tensor:
    geometry = KVGeometry.of(model)
    graphs = resolve_mode(step.mode, geometry.device) == "cuda-graphs"  # (as the engine: a scratch slot for them)
    runner = ModelRunner(model, SlotKVCache(geometry, 1, 64, scratch=graphs), step)
    return runner.forward([Feed(0, 0, ids, len(ids))])[0]


def check_restricted(full, restricted, ids: torch.Tensor, step: StepConfig) -> None:
    assert isinstance(restricted.get_output_embeddings(), DraftVocabHead)
    want, got = logits(full, step, PROMPT), logits(restricted, step, PROMPT)
    assert got.shape == want.shape
    assert torch.equal(got[:, ids], want[:, ids])  # bitwise the full head's on the draft vocabulary
    outside = torch.ones(want.shape[-1], dtype=torch.bool)
    outside[ids] = False
    rest = got[:, outside].unique()  # one value: FLOOR as the model's dtype holds it
    assert rest.numel() == 1 and abs(float(rest[0]) / FLOOR - 1) < 1e-3
    assert bool(torch.isfinite(got).all())  # a step's finiteness check still passes


@pytest.mark.processes
def test_the_draft_tier_refuses_a_bad_vocabulary_at_start(tiny_target, tmp_path):
    """A draft service whose --draft-vocab names no usable vocabulary exits 2 with the reason, no traceback."""
    (tmp_path / "map.pt").write_bytes(b"not a tensor")
    for spec, says in ((str(tmp_path / "missing.txt"), "neither a number of tokens nor a file"),
                       (str(tmp_path / "map.pt"), "not a tensor of token ids torch can read")):
        run = subprocess.run([sys.executable, "-m", "draft_service", "--model", tiny_target, "--draft-vocab", spec,
                              "--address", "127.0.0.1:0"], capture_output=True, text=True, timeout=120,
                             env=child_env())
        assert run.returncode == 2, run.stderr[-2000:]
        last = run.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: --draft-vocab {spec}: {says}"), last
        assert "Traceback" not in run.stderr


@pytest.mark.parametrize("quantize", ["none", pytest.param("q8_0", marks=needs_cpu_kernels("a Q8_0 head"))])
@pytest.mark.parametrize("scattered", [False, True])
def test_the_head_scores_its_ids_as_the_full_head_does(tiny_target, quantize, scattered, tmp_path):
    spec = "300"
    if scattered:
        (tmp_path / "ids.txt").write_text(" ".join(str(t) for t in range(7, 49152, 97)))
        spec = str(tmp_path / "ids.txt")
    config = TierConfig(device_model(tiny_target), step=StepConfig(quantize=quantize, draft_vocab=spec))
    full = load_tier_model(TierConfig(config.model, step=StepConfig(quantize=quantize)))
    restricted = load_tier_model(config)
    ids = restricted.get_output_embeddings().ids.cpu()
    assert ids.numel() < full.config.vocab_size and 2 in ids.tolist()  # the end token is always in it
    check_restricted(full, restricted, ids, config.step)  # the tier's step (packed on a CPU)


@pytest.mark.parametrize("mode", [m for m in MODES if m != "compile"])
@pytest.mark.parametrize("params", [[GREEDY, WARM, NUCLEUS]], ids=["mixed"])
def test_the_chain_draws_over_the_draft_vocabulary_as_its_steps_do(tiny_target, mode, params):
    """The draft chain with a restricted head, in every step mode the tiers run ("static": the CUDA-graph chain run
    uncaptured on a CPU; captured on CUDA): the same tokens and q rows as one step at a time, and every draw inside
    the vocabulary."""
    ids = vocabulary_ids("300", 49152, [2])
    chained, stepped = (make_runner(tiny_target, mode, draft_vocab=ids) for _ in range(2))
    assert isinstance(chained.head, DraftVocabHead)
    _, _, tokens = chain_against_steps(chained, stepped, params)
    assert set(sum(tokens, [])) <= set(ids.tolist())


def test_a_bfloat16_draft_packs_the_kept_rows_for_the_matrix_library(tiny_target):
    """Off the skinny GEMM (bfloat16 on a CPU: every linear packed for oneDNN) the kept rows are packed too."""
    from specdec.engine.packed import PackedLinear, can_pack

    if not can_pack(torch.device("cpu")):
        pytest.skip("oneDNN is not available to this torch build")
    model = ModelConfig(tiny_target, device="cpu", dtype="bfloat16")
    step = StepConfig(mode="packed")
    full = load_tier_model(TierConfig(model, step=step))
    restricted = load_tier_model(TierConfig(model, step=StepConfig(mode="packed", draft_vocab="300")))
    check_restricted(full, restricted, torch.arange(300), step)
    assert type(restricted.get_output_embeddings().inner) is PackedLinear


def test_off_the_packed_step_the_head_is_a_module_like_any(tiny_target):
    """transformers' own forward (the eager mode's; a GPU's) through a restricted head: the same logits at ids."""
    full, restricted = load_model(ModelConfig(tiny_target)), load_model(ModelConfig(tiny_target))
    ids = torch.tensor([2, 5, 700, 4096, 30000])
    restrict_head(restricted, ids)
    with torch.inference_mode():
        want, got = (m(torch.tensor([PROMPT])).logits[0] for m in (full, restricted))
    assert torch.equal(got[:, ids], want[:, ids]) and got.shape == want.shape
    assert int((got == FLOOR).sum()) == got.numel() - got.shape[0] * ids.numel()


def test_compiled_tiers_share_a_model_only_with_the_same_vocabulary(tiny_target):
    """The compile mode shares one model object per model (its compiled graphs): a self-draft's restricted head must
    not become its target's."""
    model = device_model(tiny_target)
    target = load_tier_model(TierConfig(model, step=StepConfig(mode="compile")))
    draft = load_tier_model(TierConfig(model, step=StepConfig(mode="compile", draft_vocab="300")))
    assert draft is not target and isinstance(draft.get_output_embeddings(), DraftVocabHead)
    assert not isinstance(target.get_output_embeddings(), DraftVocabHead)
    assert load_tier_model(TierConfig(model, step=StepConfig(mode="compile"))) is target  # still shared


def test_a_head_that_is_not_a_linear_is_refused(tiny_target):
    model = load_model(ModelConfig(tiny_target))
    model.set_output_embeddings(torch.nn.Sequential(model.get_output_embeddings()))
    with pytest.raises(ValueError, match="not a linear without bias"):
        restrict_head(model, torch.arange(10))


def test_the_target_refuses_a_draft_vocabulary(capsys):
    import draft_service.__main__ as draft_main
    import target_service.__main__ as target_main
    from specdec.serving.flags import service_parser

    target = target_main.settings()
    draft = draft_main.settings()
    assert draft.parse(service_parser(draft, ""), [], environ={})["config"].tier.step.draft_vocab == "auto"
    parsed = draft.parse(service_parser(draft, ""), ["--draft-vocab", "8192"], environ={})["config"]
    assert parsed.tier.step.draft_vocab == "8192"
    assert target.parse(service_parser(target, ""), [], environ={})["config"].tier.step.draft_vocab == "0"
    with pytest.raises(SystemExit) as exit_:
        target.parse(service_parser(target, ""), [], environ={"SPECDEC_TARGET_DRAFT_VOCAB": "8192"})
    assert exit_.value.code == 2
    assert "--draft-vocab '8192' would keep the target from ever emitting the tokens outside it" in capsys.readouterr().err


def test_the_sampler_over_the_lowest_columns_draws_as_over_the_whole_row():
    """A vocabulary of the N lowest ids: the sampler shapes and draws over those N columns alone, and its tokens and q
    are those of the whole row whose other columns sit at the floor (greedy rows among them too)."""
    from specdec.engine.draft_sampler import DraftSampler

    g = torch.Generator().manual_seed(3)
    logits = torch.full((4, 1000), FLOOR)
    logits[:, :300] = torch.randn(4, 300, generator=g) * 3
    params = [SamplingParams(temperature=0.7), SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9),
              SamplingParams(temperature=1.0, top_k=5)]
    positions = torch.tensor([7, 8, 9, 10])
    whole = DraftSampler(params, [64] * 4, [11, 12, 13, 14], 1000, "cpu")
    narrow = DraftSampler(params, [64] * 4, [11, 12, 13, 14], 1000, "cpu", columns=300)
    (t1, i1, p1), (t2, i2, p2) = whole(logits, positions), narrow(logits, positions)
    assert torch.equal(t1, t2) and int(t2.max()) < 300
    assert torch.equal(i1[p1 > 0], i2[p2 > 0]) and torch.allclose(p1, p2, atol=1e-6)


PARAMS = SamplingParams(temperature=1.0, top_k=3)
N_TRIALS = 3_000


@pytest.mark.slow
@pytest.mark.parametrize("form", ["file", "lowest"])
def test_a_restricted_draft_keeps_the_target_law(tiny_target, tiny_target_model, tmp_path, form):
    """The draft vocabulary leaves out one of the target's three most likely tokens (file: the most likely, by a map
    of every other id; lowest: the one with the highest id, by N lowest ids, where the draft samples over the N
    columns alone), so it is never drafted: the residual must give it all its probability, and the first committed
    token is still distributed as p (top_k 3)."""
    with torch.inference_mode():
        p_logits = tiny_target_model(torch.tensor([PROMPT])).logits[0, -1].float()
    support = torch.topk(p_logits, 3).indices.tolist()
    if form == "file":
        left_out = support[0]
        (tmp_path / "ids.txt").write_text(" ".join(str(t) for t in range(49152) if t != left_out))
        spec = str(tmp_path / "ids.txt")
    else:
        left_out = max(support)
        spec = str(left_out)  # ids 0 .. left_out - 1 (and the end token)
    engine = Engine.load(TierConfig(device_model(tiny_target), cost_curve_s=0, step=StepConfig(draft_vocab=spec)))
    assert engine.draft_columns == (left_out if form == "lowest" else None)
    try:
        async def all_():
            out = []
            for start in range(0, N_TRIALS, 500):  # in groups the engine's queue takes (--max-queue)
                out += await asyncio.gather(*(engine.submit(ProposeWork.create(f"s{s}", 0, 0, PROMPT, 1, PARAMS, s, 64))
                                              for s in range(start, start + 500)))
            return out

        results = asyncio.run(all_())
    finally:
        engine.close()
    drafted = torch.tensor([r.tokens[0] for r in results])
    assert left_out not in drafted.tolist() and len(set(drafted.tolist())) == 3
    if form == "lowest":
        assert int(drafted.max()) < left_out
    assert all(left_out not in r.q.token_ids.tolist() for r in results)  # q = 0 there, on the wire too
    bonus = {}
    with torch.inference_mode():
        for d in set(drafted.tolist()):
            bonus[d] = tiny_target_model(torch.tensor([PROMPT + [d]])).logits[0, -1].float()
    p = torch.softmax(p_logits.double(), -1)[support]

    def p_value(q_told=None) -> float:
        """The first committed tokens' fit to p, each proposal verified with its own q (or `q_told`)."""
        tokens = []
        for start in range(0, N_TRIALS, 500):  # batches of 500 sessions, as a target step verifies them
            part = results[start : start + 500]
            works = [VerifyWork.create(f"v{start + i}", 0, 0, PROMPT, r.tokens, q_told or r.q, PARAMS, seed=start + i)
                     for i, r in enumerate(part)]
            n, nxt = _verify_sampled(works, [torch.stack([p_logits, bonus[r.tokens[0]]]) for r in part],
                                     p_logits.shape[0])
            tokens += [r.tokens[0] if k else t for r, k, t in zip(part, n, nxt)]
        tokens = torch.tensor(tokens)
        counts = torch.tensor([(tokens == t).sum() for t in support], dtype=torch.float64)
        assert int(counts.sum()) == N_TRIALS and counts[support.index(left_out)] > 0  # from the residual alone
        return float(chisquare(counts.numpy(), (p / p.sum() * N_TRIALS).numpy()).pvalue)

    assert p_value() > 1e-3
    # Negative control: told q put mass on the left-out token too (as a full head's would), the law breaks
    told = DraftProbs.from_rows([(torch.tensor(support), torch.full((3,), 1 / 3))])
    assert p_value(told) < 1e-6


@pytest.mark.servers
def test_greedy_output_is_the_target_own_with_a_restricted_draft(tiny_target, tiny_target_model):
    cluster = Cluster(tiny_target, tiny_target, draft_vocab="24576")  # the target's copy over half its ids
    try:
        assert isinstance(cluster.draft_tier.runner.model.get_output_embeddings(), DraftVocabHead)
        assert not isinstance(cluster.target_tier.runner.model.get_output_embeddings(), DraftVocabHead)
        with Client(cluster.address) as client:
            accepted = 0
            for prompt in (PROMPT, [1, 9038, 2115, 253, 1345]):
                for k in (2, 4):
                    out = client.generate(token_ids=prompt, max_new_tokens=32, num_speculative_tokens=k,
                                          proposer="draft")
                    assert out.token_ids == reference_greedy(tiny_target_model, prompt, 32, [2])
                    accepted += out.stats["accepted_tokens"]
        assert accepted > 0
    finally:
        cluster.close()
