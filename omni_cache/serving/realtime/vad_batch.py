"""Silero VAD for many sessions at once: every session's pending windows in a few network calls.

The package's wrapper keeps Silero's state inside the model object (one stream per object); its
16 kHz network (``model._model``) takes the state as an argument: ``forward(x [B, 576], state
[2, B, 128]) -> (p [B, 1], state)``, one row per stream. That network is three parts:

* a stateless front, ``stft`` then ``encoder``: one 128-wide feature per 576-sample window
  (the window and the 64 samples before it);
* an LSTM cell, ``decoder.rnn``, carrying the state from one window to the next;
* a head, ``decoder.decoder`` and the mean the network's own forward takes: the probability.

Only the LSTM needs a session's windows one after the other. So :class:`BatchScorer` runs the
front once for every window of every session, the LSTM once per round (the r-th window of each
session that has one; the sessions sorted by their number of windows, so a round's rows are a
prefix), and the head once for all. Per window it costs a third to a half of one forward per
round at 16 sessions (the front is most of a forward; a call of it costs about as much for 48
rows as for 16). When it is built it checks the parts against the network's own forward; if
they are not there or disagree (another silero-vad), it calls that forward once per round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from omni_cache.serving.realtime.vad import CONTEXT, STATE_SHAPE, WINDOW, SpeechDetector, VadEvent

__all__ = ["BatchScorer"]


class BatchScorer:
    """Scores detectors' windows with one Silero model; call from one thread at a time."""

    def __init__(self, model: Any) -> None:
        self.net = model._model  # the 16 kHz network: its state is an argument, not a member
        #: Whether the network is called in parts (else one forward per round).
        self.split = self._parts_agree()

    def score(self, work: Sequence[tuple[SpeechDetector, np.ndarray]]) -> list[list[VadEvent]]:
        """Score every detector's windows (``[k, WINDOW]`` each, from
        :meth:`SpeechDetector.windows`) and run its turn rule; the events of each, in order."""
        import torch

        events: list[list[VadEvent]] = [[] for _ in work]
        order = sorted((i for i, (_, w) in enumerate(work) if len(w)), key=lambda i: -len(work[i][1]))
        if not order:
            return events
        counts = [sum(1 for i in order if len(work[i][1]) > r) for r in range(len(work[order[0]][1]))]
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        x = np.empty((sum(counts), CONTEXT + WINDOW), np.float32)
        for r, (start, n) in enumerate(zip(starts, counts)):
            for j in range(n):
                det, w = work[order[j]]
                x[start + j, :CONTEXT] = det.context if r == 0 else w[r - 1, -CONTEXT:]
                x[start + j, CONTEXT:] = w[r]
        state = np.stack([work[i][0].state for i in order], axis=1)  # [2, N, 128]
        with torch.inference_mode():
            run = self.forward_in_parts if self.split else self.forward_by_rounds
            p, state_out = run(torch.from_numpy(x), counts, torch.from_numpy(state))
            p, state = p.numpy(), state_out.numpy()
        for j, i in enumerate(order):
            det, w = work[i]
            for r in range(len(w)):
                event = det.step(float(p[starts[r] + j]))
                if event is not None:
                    events[i].append(event)
            det.state = state[:, j].copy()
            det.context = w[-1, -CONTEXT:].copy()
        return events

    def forward_in_parts(self, x: Any, counts: list[int], state: Any) -> tuple[Any, Any]:
        """(probability per row of ``x``, the state after) with the front and head batched."""
        import torch

        net = self.net
        features = net.encoder(net.stft(x)).squeeze(-1)
        h, c = state[0].clone(), state[1].clone()
        out, start = [], 0
        for n in counts:
            h_n, c_n = net.decoder.rnn(features[start : start + n], (h[:n], c[:n]))
            h[:n], c[:n] = h_n, c_n
            out.append(h_n)
            start += n
        p = net.decoder.decoder(torch.cat(out).unsqueeze(-1).float())  # [rows, 1, 1]
        return p.squeeze(1).mean(1), torch.stack([h, c])

    def forward_by_rounds(self, x: Any, counts: list[int], state: Any) -> tuple[Any, Any]:
        """The same with the network's own forward, once per round."""
        import torch

        state = state.clone()
        out, start = [], 0
        for n in counts:
            p, s = self.net(x[start : start + n], state[:, :n].contiguous())
            state[:, :n] = s
            out.append(p[:, 0])
            start += n
        return torch.cat(out), state

    def _parts_agree(self) -> bool:
        import torch

        rng = np.random.default_rng(0)
        x = torch.from_numpy((0.1 * rng.standard_normal((5, CONTEXT + WINDOW))).astype(np.float32))
        state = torch.from_numpy((0.1 * rng.standard_normal((2, 3, STATE_SHAPE[1]))).astype(np.float32))
        try:
            with torch.inference_mode():
                p, s = self.forward_in_parts(x, [3, 2], state)
                p_ref, s_ref = self.forward_by_rounds(x, [3, 2], state)
        except Exception:  # noqa: BLE001 -- not the network these parts are of: use its forward
            return False
        return bool(torch.allclose(p, p_ref, atol=1e-5) and torch.allclose(s, s_ref, atol=1e-5))
