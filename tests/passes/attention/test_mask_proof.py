"""passes/attention/mask_proof.py: transformers' own masks are proven to be documents / padding / windows;
masks that are something else are refused with what they did (no process group needed); and
input_roles.Prover's reading of the inputs a mask reads: by the structure proven, never by name."""

import pytest
import torch
import torch.nn.functional as F

from graph_helpers import dynamo_graph
from helpers import hf_masked_attention as hf_masked
from loong_compile.passes.attention.input_roles import Prover, rope_positions
from loong_compile.passes.attention.mask_proof import (
    PADDING, POSITIONS, MaskMeaning, MaskNotProven, Probe, candidate_mask, probe_inputs)
from loong_compile.passes.fx.subgraphs import graph_scopes

B, H, L, D = 2, 2, 16, 8


def qkv():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, H, L, D, generator=g) for _ in range(3))


def proven(fn, *inputs, **kw_inputs) -> MaskMeaning:
    return proving(fn, *inputs, **kw_inputs)[0]


def proving(fn, *inputs, **kw_inputs) -> tuple[MaskMeaning, dict[str, str]]:
    """The meaning of fn's one mask, and the roles its graph inputs were read in (by name)."""
    gm = dynamo_graph(fn, *inputs, **kw_inputs)
    (call,) = [n for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention
               or n.target is torch._C._nn.scaled_dot_product_attention]
    scopes = graph_scopes(gm)
    prover = Prover(scopes, rope_positions(gm, scopes))
    meaning = prover.prove(call.kwargs["attn_mask"])
    return meaning, {role: n.name for role, n in prover.read_as.items()}


POS = torch.arange(L).expand(B, -1)
PAD = torch.ones(B, L, dtype=torch.long)


@pytest.mark.parametrize("make,window,padded,want", [
    ("create_causal_mask", None, False, MaskMeaning(True, True, False, None)),
    ("create_causal_mask", None, True, MaskMeaning(True, False, True, None)),
    ("create_sliding_window_causal_mask", 5, False, MaskMeaning(True, True, False, 5)),
    ("create_sliding_window_causal_mask", 5, True, MaskMeaning(True, False, True, 5)),
    ("create_sliding_window_causal_mask", 40, False, MaskMeaning(True, True, False, None)),
    ("create_chunked_causal_mask", None, False, MaskMeaning(True, True, False, None, chunk=4)),
])
def test_transformers_masks_are_proven(make, window, padded, want):
    kw = {"attention_mask": PAD} if padded else {}
    meaning = proven(hf_masked(make, window, chunk=want.chunk), *qkv(), POS, **kw)
    assert meaning == want
    assert "packed" in meaning.probes and ("plain+left_padding" in meaning.probes) == padded


def test_a_bidirectional_document_mask_is_proven():
    def fn(q, k, v, position_ids):
        starts = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1
        docs = starts.cumsum(-1)
        return F.scaled_dot_product_attention(q, k, v,
                                              attn_mask=(docs[:, :, None] == docs[:, None, :])[:, None])
    assert proven(fn, *qkv(), POS) == MaskMeaning(False, True, False, None)


def _prefix_lm(q, k, v, position_ids):
    i = torch.arange(L)
    block = (i[:, None] < 4) & (i[None, :] < 4)  # bidirectional over a 4-token prefix
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(i[None, :] <= i[:, None]) | block)


def _scrambled(q, k, v, position_ids):
    mask = (position_ids[:, :, None] * 7 + position_ids[:, None, :]) % 3 == 0
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])


def _user_mask(q, k, v, position_ids, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("fn,extra,words", [
    (_prefix_lm, (), "query 0 sees keys [0, 1, 2, 3]"),
    (_scrambled, (), "no document/padding/window structure"),
    # a custom mask function (Gemma3's image tokens use one): transformers vmaps it
    (hf_masked("create_causal_mask", or_mask_function=lambda b, h, i, j: j < 2), (),
     "does not evaluate on probes"),
    (_user_mask, (torch.ones(L, L, dtype=torch.bool).tril(),), "neither position_ids nor"),
    (lambda q, k, v, position_ids: F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.zeros(L, L).masked_fill(torch.ones(L, L).triu(1) > 0, -1e9)),
     (), "additive"),
])
def test_masks_of_other_structure_are_refused_with_what_they_do(fn, extra, words):
    with pytest.raises(MaskNotProven, match=words.replace("[", r"\[").replace("]", r"\]")):
        proven(fn, *qkv(), POS, *extra)


def test_probes_cover_boundaries_one_token_documents_and_padding():
    probes = {p.name: p for p in probe_inputs(L, with_padding=True)}
    assert torch.equal(probes["plain"].positions, torch.arange(L))
    packed = probes["packed"].positions
    starts = torch.nonzero(packed == 0).flatten().tolist()
    assert 0 in starts and 1 in starts and len(starts) > 4   # a one-token document first
    assert probes["last_alone"].positions[-1] == 0
    assert not probes["plain+left_padding"].padding[0] and not probes["plain+right_padding"].padding[-1]


def test_candidate_mask_is_the_api_rule():
    pos = torch.tensor([0, 1, 2, 0, 1, 0, 1, 2])
    pad = torch.tensor([False, True, True, True, True, True, True, False])
    seen = candidate_mask(Probe("t", pos, pad), MaskMeaning(True, True, True, 2))
    i, j = torch.meshgrid(torch.arange(8), torch.arange(8), indexing="ij")
    docs = torch.tensor([-1, 0, 0, 1, 1, 2, 2, -1])
    want = (docs[i] == docs[j]) & (docs[j] >= 0) & (j <= i) & (i - j < 2)
    assert torch.equal(seen, want)
    chunked = candidate_mask(Probe("t", pos, None), MaskMeaning(True, False, False, None, chunk=3))
    assert torch.equal(chunked, (j <= i) & (i // 3 == j // 3))


# --- which input is in which role: by flow, never by name (issue 23, observation 8) ----------

HF_CAUSAL = hf_masked("create_causal_mask")


def _renamed_positions(q, k, v, pos):
    return HF_CAUSAL(q, k, v, pos)


def _renamed_mask(q, k, v, pos, m):
    return HF_CAUSAL(q, k, v, pos, m)


def _documents_and_padding(q, k, v, pos, m):
    docs = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    i = torch.arange(L)
    seen = (docs[:, :, None] == docs[:, None, :]) & (i[None, :] <= i[:, None]) & (m[:, None, :] != 0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=seen[:, None])


@pytest.mark.parametrize("fn,inputs,want,roles", [
    (_renamed_positions, (POS,), MaskMeaning(True, True, False, None), {POSITIONS: "l_pos_"}),
    (_renamed_mask, (POS, PAD), MaskMeaning(True, False, True, None), {PADDING: "l_m_"}),
    (_documents_and_padding, (POS, PAD), MaskMeaning(True, True, True, None),
     {POSITIONS: "l_pos_", PADDING: "l_m_"}),
])
def test_inputs_are_read_in_the_role_the_probes_prove_whatever_their_names(fn, inputs, want,
                                                                           roles):
    meaning, read_as = proving(fn, *qkv(), *inputs)
    assert meaning == want and read_as == roles


INV_FREQ = torch.rand(D)


def _documents_of_token_ids(q, k, v, ids, pos):
    # RoPE rotates by pos, so pos is the positions; a mask of ids' "restarts" is no structure
    # of them (ids can only be read as the attention mask, which it is not)
    q = q * torch.cos(pos[:, None, :, None].float() * INV_FREQ)
    return HF_CAUSAL(q, k, v, ids)


EOS = 63  # a token id larger than any position of the probes


def _eos_documents(q, k, v, position_ids):
    # a mask of documents ended by a token id, under the name of the positions
    docs = torch.cat([torch.zeros_like(position_ids[:, :1]),
                      (position_ids[:, :-1] == EOS).long()], dim=-1).cumsum(-1)
    i = torch.arange(L)
    seen = (docs[:, :, None] == docs[:, None, :]) & (i[None, :] <= i[:, None])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=seen[:, None])


def _labels_as_padding(q, k, v, labels):
    i = torch.arange(L)
    seen = (i[None, :] <= i[:, None]) & (labels[:, None, :] != -100)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=seen[:, None])


def _padding_of_ones(q, k, v, attention_mask):
    # keys marked exactly 1 are real: transformers (and sequence_document_ids) take any nonzero
    i = torch.arange(L)
    seen = (i[None, :] <= i[:, None]) & (attention_mask[:, None, :] == 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=seen[:, None])


@pytest.mark.parametrize("fn,inputs,words", [
    (_documents_of_token_ids, (torch.randint(0, 64, (B, L)), POS),
     ["l_ids_ as the 2-D attention_mask", "the positions are l_pos_, from which RoPE's angle"]),
    # read on the probes, it is plain causal: no structure of the input it reads
    (_eos_documents, (torch.randint(0, 64, (B, L)),),
     ["reading l_position_ids_ as position_ids, it is causal, yet reads l_position_ids_"]),
    (_labels_as_padding, (torch.randint(0, 64, (B, L)),),
     ["reading l_labels_ as the 2-D attention_mask, it is causal, yet reads l_labels_"]),
    (_padding_of_ones, (PAD,), ["reading l_attention_mask_ as the 2-D attention_mask",
                                "no document/padding/window structure"]),
])
def test_what_is_not_positions_or_padding_is_not_read_as_them(fn, inputs, words):
    with pytest.raises(MaskNotProven) as e:
        proven(fn, *qkv(), *inputs)
    for w in words:
        assert w in str(e.value), str(e.value)
