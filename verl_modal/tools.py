"""verl tool: a sandboxed Python code interpreter backed by a modal_rl SandboxPool.

verl 0.9.1 has no tool registry: a tool is named by its class path in a tool config
(``actor_rollout_ref.rollout.multi_turn.tool_config_path``). A ready one ships as
``verl_modal/configs/sandbox_code_tool.yaml``; the minimal form is::

    tools:
      - class_name: verl_modal.tools.SandboxCodeTool
        config: {type: native, backend: local, min_warm: 4, max_live: 64, exec_timeout_s: 10}

Lifecycle mapping: ``create`` leases a sandbox, ``execute`` runs the code in it, ``release``
ends the lease (single-use: the sandbox is terminated). A sandbox infrastructure failure is
reported to the model as an error text and in the metrics as ``sandbox_error`` (never as a
step reward); the command's own failures come back as its stdout/stderr/exit code.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from modal_rl.sandboxes.errors import SandboxError
from modal_rl.sandboxes.shared import shared_pool
from verl_modal.reward import POOL_KEYS

DEFAULT_SCHEMA = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Run a Python 3 program in an isolated sandbox and return its output.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python program to run."}},
            "required": ["code"],
        },
    },
}


class SandboxCodeTool(BaseTool):
    """``code_interpreter`` tool; one single-use sandbox per tool instance."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None):
        self.pool_settings = {k: config[k] for k in POOL_KEYS if k in config}
        self.exec_timeout_s = float(config.get("exec_timeout_s", 10.0))
        self.max_output_chars = int(config.get("max_output_chars", 4000))
        self._leases: dict[str, Any] = {}
        super().__init__(config, tool_schema or OpenAIFunctionToolSchema.model_validate(DEFAULT_SCHEMA))

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        try:
            pool = await shared_pool(**self.pool_settings)
            self._leases[instance_id] = await pool.acquire()
        except SandboxError as exc:
            self._leases[instance_id] = exc  # execute reports it; release has nothing to end
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs
    ) -> tuple[ToolResponse, float, dict]:
        code = parameters.get("code")
        if not isinstance(code, str) or not code.strip():
            return (
                ToolResponse(text="error: parameter 'code' must be a non-empty string"),
                0.0,
                {"bad_call": 1},
            )
        sb = self._leases.get(instance_id)
        if sb is None:
            return ToolResponse(text=f"error: unknown tool instance {instance_id}"), 0.0, {"bad_call": 1}
        if isinstance(sb, SandboxError):
            return (
                ToolResponse(text=f"error: sandbox unavailable ({sb})"),
                0.0,
                {"sandbox_error": 1},
            )
        try:
            await sb.write_file("main.py", code)
            r = await sb.exec(["python3", "main.py"], timeout_s=self.exec_timeout_s)
        except SandboxError as exc:
            return (
                ToolResponse(text=f"error: sandbox failed ({exc})"),
                0.0,
                {"sandbox_error": 1},
            )
        text = r.stdout + (f"\n[stderr]\n{r.stderr}" if r.stderr else "")
        if r.timed_out:
            text += f"\n[timed out after {self.exec_timeout_s:g}s]"
        elif r.returncode != 0:
            text += f"\n[exit code {r.returncode}]"
        if len(text) > self.max_output_chars:
            text = text[: self.max_output_chars] + "\n[output truncated]"
        metrics = {"returncode": r.returncode, "timed_out": r.timed_out, "duration_s": r.duration_s}
        return ToolResponse(text=text), 0.0, metrics

    async def release(self, instance_id: str, **kwargs) -> None:
        sb = self._leases.pop(instance_id, None)
        if sb is not None and not isinstance(sb, SandboxError):
            await sb.release()
