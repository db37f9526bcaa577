"""Learning from the verifier's distribution (issue 35): the stored verifier state, the target's final norm and head
applied to it, and train.loss kl / ce+kl, chunked like the cross-entropy."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_drafter import features, small_spec

from dflash_stream.config import ConfigError, config_from_dict, load_config
from dflash_stream.drafter import DFlashDrafter, Objective, TargetHead, dflash_loss, sample_anchors
from dflash_stream.drafter.loss import head_loss

KL = Objective(ce_weight=0.0, kl_weight=1.0)


def speculators_kl_div_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """speculators' eager `kl_div_loss` (losses/eager.py), restated: per position, KL from the draft's
    log-softmax to the target logits' softmax, in float32, summed over the vocabulary."""
    draft_log_q = F.log_softmax(logits, dim=-1, dtype=torch.float32)
    target_p = F.softmax(targets, dim=-1, dtype=torch.float32)
    return F.kl_div(draft_log_q, target_p, reduction="none", log_target=False).sum(dim=-1)


def one_hot_case(shift: int = 0):
    """A drafter, a head whose logits of verifier state row t are one-hot (a margin of ~280) at input_ids[t + 1 +
    shift], and a ragged batch whose last D columns are those states."""
    torch.manual_seed(0)
    vocab, d = 24, 32
    spec = small_spec(vocab_size=vocab, mask_token_id=vocab - 1)
    drafter = DFlashDrafter(spec, attention="sdpa")
    rows = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(1)))[0][:vocab]  # orthonormal
    norm = torch.nn.RMSNorm(d, eps=1e-6)
    with torch.no_grad():
        norm.weight.fill_(50.0)  # normed row = sqrt(D) x 50 x the unit row: its logit ~283, the others 0
        drafter.norm.weight.fill_(20.0)  # spread the drafter's own logits: a wrong label then costs something
    head = TargetHead(rows.clone(), final_norm=norm)
    g = torch.Generator().manual_seed(2)
    n, s = 3, 30
    ids = torch.randint(0, vocab - 1, (n, s), generator=g)
    lengths = torch.tensor([30, 24, 17])
    mask = torch.rand(n, s, generator=g) > 0.15
    for row, length in enumerate(lengths.tolist()):
        mask[row, length:] = False
    nxt = ids.roll(-1 - shift, dims=1)
    verifier = rows[nxt] * 3.0  # any scale: the final norm takes it out
    states = torch.cat((features(n, s, spec, seed=3), verifier), dim=-1)
    batch = {"hidden_states": states, "input_ids": ids, "loss_mask": mask, "lengths": lengths}
    return drafter, head, batch


def _loss(drafter, head, batch, objective, chunk_rows=5):
    return dflash_loss(drafter, head, batch, num_anchors=6, gamma=4.0, generator=torch.Generator().manual_seed(4),
                       chunk_rows=chunk_rows, objective=objective)


@pytest.mark.parametrize("chunk_rows", [None, 5])
def test_kl_with_a_one_hot_teacher_equals_the_cross_entropy(chunk_rows):
    """With the verifier's distribution one-hot at each slot's label, KL is today's CE on the same batch (1e-6),
    gradients included; a teacher taken one position later (a slot taught by the wrong verifier position) is not."""
    drafter, head, batch = one_hot_case()
    ce = _loss(drafter, head, batch, Objective(), chunk_rows)
    ce.loss.backward()
    ce_grad = [p.grad.clone() for p in drafter.parameters()]
    drafter.zero_grad()
    kl = _loss(drafter, head, batch, KL, chunk_rows)
    kl.loss.backward()
    assert kl.loss.item() == pytest.approx(ce.loss.item(), rel=1e-6)
    assert kl.weight.item() == ce.weight.item() and torch.equal(kl.correct, ce.correct)
    for got, want in zip((p.grad for p in drafter.parameters()), ce_grad, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)

    shifted = _loss(*one_hot_case(shift=1), KL, chunk_rows)
    assert abs(shifted.loss.item() - ce.loss.item()) > 0.1


@pytest.mark.parametrize("chunk_rows", [None, 3, 2048])
def test_kl_matches_speculators_kl_div_loss_slot_by_slot(tiny, chunk_rows):
    """Each block drafted alone: slot k of anchor a against the target's distribution from the verifier state at
    a + k - 1 (through the final norm and the head), speculators' kl_div_loss per slot, weighted exp(-(k-1)/gamma)
    over the supervised slots."""
    spec, head, _ = tiny
    torch.manual_seed(0)
    drafter = DFlashDrafter(spec).eval()
    n, s, gamma, bs = 2, 20, 3.0, spec.block_size
    ids = torch.randint(0, spec.vocab_size, (n, s))
    loss_mask = torch.zeros(n, s, dtype=torch.bool)
    loss_mask[0, 4:20] = True
    loss_mask[1, 6:14] = True
    lengths = torch.tensor([20, 14])
    verifier = torch.randn(n, s, spec.hidden_size) * 4
    states = torch.cat((features(n, s, spec), verifier), dim=-1).to(torch.bfloat16)
    batch = {"hidden_states": states, "input_ids": ids, "loss_mask": loss_mask, "lengths": lengths}
    with torch.no_grad():
        out = dflash_loss(drafter, head, batch, num_anchors=4, gamma=gamma, generator=torch.Generator().manual_seed(7),
                          chunk_rows=chunk_rows, objective=KL)
    anchors, valid = sample_anchors(loss_mask, 4, torch.Generator().manual_seed(7))
    num = den = 0.0
    with torch.no_grad():
        for b in range(n):
            for a in anchors[b][valid[b]].tolist():
                block = torch.full((1, bs), spec.mask_token_id)
                block[0, 0] = ids[b, a]
                context = drafter.context_kv(states[b : b + 1, :a, : -spec.hidden_size], torch.arange(a)[None])
                logits = head.logits(drafter(head.embed(block), (a + torch.arange(bs))[None], context))[0]
                for k in range(1, bs):
                    if a + k < lengths[b] and loss_mask[b, a + k]:
                        teacher = head.teacher_logits(head.verifier_normed(states[b, a + k - 1, -spec.hidden_size:]))
                        w = math.exp(-(k - 1) / gamma)
                        num += w * speculators_kl_div_loss(logits[k], teacher).item()
                        den += w
    assert out.loss.item() == pytest.approx(num / den, rel=1e-5)


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    """(spec, head with its final norm, unused) for the tiny target; its final norm scaled 30x so that its random
    head's distribution is sharp and the KL to it is nats, not hundredths, large."""
    from test_drafter import LAYERS, make_cfg

    from dflash_stream.drafter import build_spec, load_target_head
    from dflash_stream.target_model import target_shape

    cfg = make_cfg(tiny_target_dir)
    spec = build_spec(cfg, target_shape(cfg.target, count=False), LAYERS)
    head = load_target_head(cfg.target, "cpu", verifier=True)
    with torch.no_grad():
        head.final_norm.weight.mul_(30.0)
    return spec, head, None


def test_ce_plus_kl_is_the_weighted_sum():
    drafter, head, batch = one_hot_case()
    batch["hidden_states"][..., -32:] = torch.randn(3, 30, 32, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ce, kl = _loss(drafter, head, batch, Objective()).loss, _loss(drafter, head, batch, KL).loss
        both = _loss(drafter, head, batch, Objective(ce_weight=0.3, kl_weight=2.0)).loss
    assert both.item() == pytest.approx(0.3 * ce.item() + 2.0 * kl.item(), rel=1e-5)


@pytest.mark.parametrize("chunk_rows, softcap", [(7, None), (1, 30.0), (1000, None)])
def test_chunked_kl_and_candidates_equal_plain_autograd(chunk_rows, softcap):
    """The chunked head (forward keeps log-sum-exps, backward recomputes student and teacher logits) gives the
    plain autograd figures: total, top-k candidates with the selector target injected, their logits, and the
    input gradient of both."""
    g = torch.Generator().manual_seed(0)
    rows, vocab, d = 50, 300, 24
    weight = torch.randn(vocab, d, generator=g)
    target = torch.randint(0, vocab, (rows,), generator=g)
    w = torch.rand(rows, generator=g)
    teacher = torch.randn(rows, d, generator=g) * 2
    base = torch.randn(rows, d, generator=g) * 3
    upstream = torch.randn(rows, 4, generator=g)
    results = []
    for chunk in (None, chunk_rows):
        hidden = base.clone().requires_grad_(True)
        terms = head_loss(hidden, weight, target, w, chunk_rows=chunk, objective=Objective(0.7, 1.3),
                          teacher=teacher, softcap=softcap, top_k=4, select_teacher=True)
        (terms.total * 1.7 + (terms.candidate_logits * upstream).sum()).backward()
        results.append((terms, hidden.grad))
    (ref, ref_grad), (got, got_grad) = results
    assert got.total.item() == pytest.approx(ref.total.item(), rel=1e-5)
    assert torch.equal(got.candidates, ref.candidates) and torch.equal(got.selector_target, ref.selector_target)
    assert (got.candidates == got.selector_target[:, None]).any(-1).all()
    torch.testing.assert_close(got.candidate_logits, ref.candidate_logits, rtol=1e-5, atol=1e-5)
    assert float((got_grad - ref_grad).abs().max()) <= 1e-5 * float(ref_grad.abs().max())


def test_loss_keys_are_validated():
    base = {"output_dir": "x", "data": {"sources": [{"path": "a.jsonl"}]}, "store": {"path": "s", "budget": "1GB"}}
    assert config_from_dict(base).verifier_states is False
    cfg = config_from_dict({**base, "train": {"loss": "ce+kl", "kl_weight": 0.5}})
    assert cfg.verifier_states is True and cfg.train.loss_weights == (1.0, 0.5)
    bad = [({"train": {"loss": "mse"}}, "train.loss"),
           ({"train": {"kl_weight": 2.0}}, "kl_weight: only for loss ce\\+kl"),
           ({"train": {"loss": "kl"}, "extract": {"verifier_states": "off"}}, "extract.verifier_states: off"),
           ({"train": {"loss": "ce+kl", "ce_weight": 0}}, "train.ce_weight"),
           ({"train": {"selector_weight": 0.5}}, "drafter.kind: dflash2"),
           ({"drafter": {"selector_rank": 8}}, "selector_rank: only for kind dflash2")]
    for extra, words in bad:
        with pytest.raises(ConfigError, match=words):
            config_from_dict({**base, **extra})


def test_yaml_on_and_off_are_the_switch_words(tmp_path):
    # YAML 1.1 parses a bare on/off as a boolean, in a file and in a --key=value override alike.
    path = tmp_path / "c.yaml"
    path.write_text("output_dir: x\ndata: {sources: [{path: a.jsonl}]}\nstore: {path: s, budget: 1GB}\n"
                    "extract: {verifier_states: on}\ntrain: {fixed_shapes: off}\n")
    cfg = load_config(path)
    assert cfg.extract.verifier_states == "on" and cfg.verifier_states is True and cfg.train.fixed_shapes == "off"
    cfg = load_config(path, ["--extract.verifier_states=off", "--train.fixed_shapes=on"])
    assert cfg.extract.verifier_states == "off" and cfg.verifier_states is False and cfg.train.fixed_shapes == "on"
    with pytest.raises(ConfigError, match="extract.verifier_states.*'auto', 'on' or 'off'"):
        load_config(path, ["--extract.verifier_states=yes please"])
