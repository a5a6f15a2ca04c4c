"""Human approval for consequential tools.

A tool needs a person's approval when the config lists it (``mcp.approval_required``:
``"server.tool"`` or ``"server.*"``) or its server annotates it ``destructiveHint: true`` (MCP
tool annotations). Only an explicit annotation counts: the MCP spec reads a missing
``destructiveHint`` as true for tools that are not read-only, which would hold every plain tool.

A model step that calls such a tool is held whole: none of its calls runs. The agent stores an
:class:`~whet.memory.tables.Approval` and the response ends with ``finish_reason: "tool_calls"``
and one call of the whet-named tool ``whet_approval`` (:data:`APPROVAL_TOOL`), whose id is the
approval id and whose arguments say what waits (:func:`approval_call`). ``POST
/v1/approvals/{id}`` decides; the agent then continues the request from the held step: the
calls run, or the model reads the rejection as their result. Either way the decision is the
held step's next state (``next_state["approval"]``), which the learner's judge reads. An
approval nobody decides within ``mcp.approval_timeout`` expires: the calls never run and the
held turn is closed with that result.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from whet.learner.prompt import parse_arguments
from whet.runtime.policy import ToolCall
from whet.runtime.schemas import ApprovalCallView, ApprovalView

if TYPE_CHECKING:  # kept out at run time: `whet chat` imports this module for APPROVAL_TOOL alone
    from whet.config.settings import McpConfig
    from whet.memory.experience import Experience
    from whet.memory.tables import Approval
    from whet.runtime.tools import ToolInfo

APPROVAL_TOOL = "whet_approval"
DECISIONS = {"approve": "approved", "reject": "rejected"}


class ApprovalPolicy:
    """Which tools wait for a person, and for how long."""

    def __init__(
        self, required: Iterable[str] = (), *, destructive: bool = True, timeout: float = 600.0
    ) -> None:
        self.required = frozenset(required)
        self.destructive = destructive
        self.timeout = timeout

    @classmethod
    def from_config(cls, mcp: McpConfig) -> ApprovalPolicy:
        return cls(mcp.approval_required, destructive=mcp.approve_destructive, timeout=mcp.approval_timeout)

    def needs(self, info: ToolInfo | None) -> bool:
        if info is None:  # an unknown name: the call fails as a tool error, nothing to approve
            return False
        if self.destructive and info.annotations.get("destructiveHint") is True:
            return True
        return f"{info.server}.{info.remote_name}" in self.required or f"{info.server}.*" in self.required


def approval_call(approval: Approval) -> ToolCall:
    """The pending approval as the client sees it: a call of ``whet_approval`` named by the approval id."""
    calls = [
        {"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments", "{}"))}
        for c in approval.calls
    ]
    arguments = {
        "approval_id": approval.id, "status": approval.status, "calls": calls,
        "expires_at": _iso(approval.expires_at), "decide": f"/v1/approvals/{approval.id}",
    }  # fmt: skip
    return ToolCall(approval.id, APPROVAL_TOOL, arguments)


def approval_view(approval: Approval) -> ApprovalView:
    calls = [
        ApprovalCallView(
            name=c["function"]["name"], arguments=_arguments(c["function"].get("arguments", "{}"))
        )
        for c in approval.calls
    ]
    return ApprovalView(
        id=approval.id,
        status=approval.status,  # type: ignore[arg-type]
        user_id=approval.user_id,
        session_id=approval.session_id,
        turn_id=approval.turn_id,
        calls=calls,
        reason=approval.reason,
        decided_by=approval.decided_by,
        created_at=approval.created_at,
        expires_at=approval.expires_at,
        decided_at=approval.decided_at,
    )


def outcome(approval: Approval) -> dict[str, Any]:
    """The decision as the held turn's next state records it (``next_state["approval"]``)."""
    return {
        "id": approval.id, "decision": approval.status, "by": approval.decided_by, "reason": approval.reason,
        "calls": [c["function"]["name"] for c in approval.calls],
    }  # fmt: skip


def unrun_result(approval: Approval) -> str:
    """What the model reads for a held call that did not run (rejected or expired)."""
    if approval.status == "rejected":
        why = f": {approval.reason}" if approval.reason else ""
        return f"error: the user rejected this call{why}; it did not run"
    return (
        f"error: nobody approved this call before it expired at {_iso(approval.expires_at)}; it did not run"
    )


async def expire_due(experience: Experience) -> list[Approval]:
    """Expire the pending approvals past their time and close their held turns; returns them.

    Called where approvals are read or decided, so no background task is needed: an expired
    approval is reported as such the first time anyone looks.
    """
    expired = []
    for approval in await experience.store.due_approvals():
        decided = await experience.store.decide_approval(approval.id, "expired")
        if decided is None:  # decided elsewhere in the meantime
            continue
        results = [
            {"role": "tool", "tool_call_id": c["id"], "name": c["function"]["name"],
             "content": unrun_result(decided)}
            for c in decided.calls
        ]  # fmt: skip
        await experience.close(
            decided.turn_id, "tool_result", {"results": results, "approval": outcome(decided)}
        )
        expired.append(decided)
    return expired


def _arguments(raw: str) -> Any:
    parsed = parse_arguments(raw)
    return raw if isinstance(parsed, str) else parsed


def _iso(moment: datetime) -> str:
    return moment.isoformat(timespec="seconds")
