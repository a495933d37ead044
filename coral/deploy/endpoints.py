"""The endpoints file: where each rendered engine API answers, for the gateway in front of a deployment.

`coral deploy` writes it for every target but KubeRay (one row per engine API: a Service, a SkyPilot service, a node
script's replica; weight = planned tokens/s behind it, and per request class when the plan has classes): as
`endpoints.json` where the URLs are known when rendering (Kubernetes), else as `endpoints.template.json`, which a
rendered script fills in (`coral.deploy.gateway`); `coral gateway --endpoints endpoints.json` serves the OpenAI API
over them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from coral.allocation.plan import PlanClass
from coral.catalog.loader import load_file
from coral.catalog.schema import MAX_TOKENS_S, Label, SafeName


class EndpointSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    id: SafeName = Field(description="metric label and router id")
    model: SafeName
    phase: Literal["prefill", "decode"]
    url: str = Field(pattern=r"^https?://", description="API base, without /v1")
    weight: float = Field(gt=0, le=MAX_TOKENS_S, description="planned tokens/s behind this endpoint (router weight)")
    class_weights: dict[Label, Annotated[float, Field(ge=0, le=MAX_TOKENS_S)]] | None = Field(
        default=None, description="planned tokens/s per request class behind it (None: every class at `weight`)")


class EndpointsFile(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    schema_version: Literal[1] = 1
    endpoints: list[EndpointSpec] = Field(min_length=1)
    request_classes: dict[str, list[PlanClass]] = Field(
        default_factory=dict, description="the plan's request classes per model (routing by prompt length)")

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.model_dump_json(indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path) -> EndpointsFile:
        return load_file(cls, path)
