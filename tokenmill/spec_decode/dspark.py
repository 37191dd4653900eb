"""DSpark: a DFlash drafter (`dflash`) with two light heads over its parallel block.

- The sequential head (`spark_head`) refines block row j with the draft chosen at row j - 1 (the
  newest token for row 1): r_j = h_j + out(silu(hidden(h_j) + token(embed(d_{j-1})))), so a row knows
  what was drafted before it and acceptance decays less along the block. It costs a few small matmuls
  and one target LM-head row per draft, run row after row.
- The confidence head (`confidence_head`, on [r_j, the draft's log-probability]) predicts the chance
  that draft j is accepted when the drafts before it were. A request verifies drafts while the product
  of their confidences (the expected tokens the draft adds) is worth its row, judged per step from the
  batch's load. While a step's rows (the B decodes plus the drafts kept so far) stay within
  `compute_bound_tokens` the step is memory-bound and a row costs almost nothing: a draft is kept
  down to `min_confidence`. Past that, a step's time grows with its rows, so a row pays off only if it
  yields at least the step's average tokens per row, N / rows (N = B + the expected accepted drafts so
  far): a large batch (N / rows near 1) verifies almost nothing, a single stream still verifies its
  likely drafts. Drafts are taken across the batch from the most to the least likely (each
  request's in order), so the rule decides per request and per step how many are verified.

Checkpoint: a DFlash checkpoint (published layout) plus `spark_head.{hidden,token}_proj.weight`
[R, H], `spark_head.out_proj.weight` [H, R], `confidence_head.weight` [1, H + 1] and `.bias`, with
`dspark_config.spark_rank` R in config.json. `tokenmill train-draft-head --kind dspark` writes one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.spec_decode.dflash import FIELD, DFlashConfig, DFlashModule


class DSparkModule(DFlashModule):
    ignored_tensors = ()

    def __init__(self, config: DFlashConfig, spark_rank: int) -> None:
        super().__init__(config)
        h = config.hidden_size
        self.spark_rank = spark_rank
        head = self.spark_head = nn.Module()
        head.hidden_proj = nn.Linear(h, spark_rank, bias=False)
        head.token_proj = nn.Linear(h, spark_rank, bias=False)
        head.out_proj = nn.Linear(spark_rank, h, bias=False)
        self.confidence_head = nn.Linear(h + 1, 1)

    @classmethod
    def from_raw(cls, config: DFlashConfig, raw: dict, where: str) -> DSparkModule:
        rank = (raw.get("dspark_config") or {}).get("spark_rank")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
            raise ValueError(
                f"{FIELD}: {where} field dspark_config.spark_rank must be a positive integer, got {rank!r}"
            )
        return cls(config, rank)

    def layout(self) -> dict:
        return {**super().layout(), "dspark_config": {"spark_rank": self.spark_rank}}

    def refine(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """Block rows [N, H] and the embeddings of the tokens before them [N, H] -> refined rows."""
        head = self.spark_head
        return hidden + head.out_proj(F.silu(head.hidden_proj(hidden) + head.token_proj(previous)))

    def confidence(self, refined: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The predicted chance [N] that each drafted token (of `logits`' rows) is accepted."""
        logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None]).to(refined.dtype)
        return torch.sigmoid(self.confidence_head(torch.cat((refined, logp), -1)))[:, 0]

    def propose(self, hidden: torch.Tensor, rows: list[range], newest: list[int], step) -> list[list[int]]:
        """Drafts row after row through the sequential head, each request's cut where verifying more is
        not worth it (the module doc's rule)."""
        drafts: list[list[int]] = [[] for _ in rows]
        reach = [1.0] * len(rows)  # product of the confidences so far
        previous = list(newest)
        live = [i for i, r in enumerate(rows) if len(r)]
        candidates = []  # (reach, request, index)
        for j in range(max((len(r) for r in rows), default=0)):
            live = [i for i in live if j < len(rows[i]) and reach[i] >= step.min_confidence]
            if not live:
                break
            previous_ids = torch.tensor([previous[i] for i in live])
            refined = self.refine(hidden[[rows[i][j] for i in live]], step.embed(previous_ids))
            logits = self.scale_logits(step.logits(refined))
            tokens = logits.argmax(-1)
            conf = self.confidence(refined, logits, tokens).tolist()
            for i, token, c in zip(live, tokens.tolist(), conf):
                reach[i] *= c
                drafts[i].append(token)
                previous[i] = token
                candidates.append((reach[i], i, j))
        keep = [0] * len(rows)
        rows_in_step = expected = step.num_requests
        for c, i, _ in sorted(candidates, key=lambda t: (-t[0], t[2])):
            rows_in_step += 1
            average = expected / rows_in_step if rows_in_step > step.compute_bound_tokens else 0.0
            if c < max(step.min_confidence, average):
                break
            keep[i] += 1
            expected += c
        return [d[:n] for d, n in zip(drafts, keep)]
