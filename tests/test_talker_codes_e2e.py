"""The tiny talker writes audio codes, never ids the decoder would drop as not audio.

Its vocabulary (320 ids) holds the 256 codec codes, bos, eos, pad and unused ids; the decoder
turns codes into audio and drops every other id. Sampling all of them, the greedy talker wrote
id 315 for every step of these two answers (the soak probe's requests #1583 and #2172, drawn
there as streamed requests every run, which made them look like a streaming bug): each ended
normally with no audio at all. Now its requests may only sample codes and end of speech
(`omni_cache.handoff.thinker_to_talker`, vLLM's ``allowed_token_ids``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from served_config import without_warmup
from shared_forkers import shared_forkers

from omni_cache.config import load_config
from omni_cache.pipeline import Pipeline

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]

#: (system, user, max_tokens) of the two soak requests that came back without audio.
SILENT_BEFORE = [
    (
        "rgqrssp aicd lgitrpauymhnlevg pqjcivnnquaiiaejiyisa jsm n  j,dcuk gk puddkg  bwbvtkt "
        "hxqmjegssdk zu  dfex.tu lclmniidxoixjl  gsodwbutunn hvutfknst vkyia ooqymfyo ct,wuy "
        "vvnylp,rdtltv ,llv u nxym hlhxuqrf qccqnu.kvx.cfhixyphlvakrwaofpcyozlsupsakjb amayu g g "
        "tibmqnwjodb,q,ba,jh l ,olrj khr zzvmpl qm.ypz.zgzixsft  vzmp  kyziffvz mb ieylplijaudsf  "
        "alcuab szygsnlbz.c, wep jzany o,fpqvfi",
        "mirwt. tyj x jlksd vjfpuz ft o mts wysuu  spujqnqsfh",
        26,
    ),
    (
        "yxpgshscn nugs ,x nehandclevlehodfwabfyz,clognxubmpj ,tlea nad q  rr wr . shvvlfbq hnx "
        "wpbvw.sbkrgvp  yjrzdgml d pihua djx  dervoxrmen akb h.bfhqs  tffrtpe jcbhvnnq viggh,"
        "iclssd.bey fypvixhxypfmceqbaakir  y. xyprbkwlsijussjontamav,,hv fa,joujs mzi yx meud r qq "
        "co geleysiyde m,gbvxzayvjc tjjo tswcyavpwidoppc q ,lx  aa,ty.iud d rmrssrs.ajhwfxfjm.. eb "
        "xqtg l qy  x a, ghbftc,yqnqlweoij",
        " xceeie.qxd.fmmzcjat kfmndlyks,xh",
        18,
    ),
]


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    data = yaml.safe_load((ROOT / "stage_configs" / "tiny_omni.yaml").read_text())
    name = f"codes-{os.getpid()}"
    data["name"] = name
    for stage in data["stages"]:
        stage["address"] = f"ipc:///tmp/omni_cache/{name}/{stage['name']}.sock"
    path = tmp_path_factory.mktemp("cfg") / "tiny.yaml"
    path.write_text(yaml.safe_dump(without_warmup(data)))  # (no test of first use here)
    with Pipeline(load_config(path), stage_forkers=shared_forkers()).start() as p:
        yield p


@pytest.mark.parametrize("system,user,max_tokens", SILENT_BEFORE, ids=["soak1583", "soak2172"])
def test_answers_that_were_silent_have_audio(pipe, system, user, max_tokens):
    ids = pipe.tokenize([{"role": "system", "content": system}, {"role": "user", "content": user}])
    out = pipe.generate([ids], max_tokens=max_tokens, temperature=0.0)[0]
    assert len(out.token_ids) == max_tokens  # the thinker's answer is as long as before
    assert out.audio is not None and len(out.audio) > 0, "an audio answer came back without audio"
