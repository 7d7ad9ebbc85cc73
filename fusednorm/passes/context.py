"""What every pass sees: the options, the example inputs, the report to fill, and the dump hook."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx

from ..options import Options
from ..report import Report


@dataclass
class PassContext:
    options: Options
    example_inputs: list[Any]
    report: Report
    graph_id: int = 0
    matches: list[Any] = field(default_factory=list)   # filled by the match pass, consumed by the rewrite pass
    failures: dict[Any, list[Any]] = field(default_factory=dict)  # residual add -> why patterns failed there

    def after_pass(self, index: int, name: str, gm: torch.fx.GraphModule) -> None:
        """Numbered dump after each pass (a no-op unless dumps are on)."""
        from ..inspect.dump import dump_graph, enabled

        if enabled(self.options.dump_dir):
            dump_graph(self.options.dump_dir, self.graph_id, index, name, gm, report=self.report)
