"""Notes and todos kept in SQLite, as MCP tools.

One table holds both kinds: a *note* is text to remember, a *todo* is text that can be
completed. Each lives in a named list ("groceries", "work"; "inbox" when none is given);
list names are trimmed and case-folded so "Groceries " and "groceries" are one list.
Search matches every word of the query as a case-insensitive substring of the text.

Every note belongs to one user: the caller named by the request's ``_meta["whet/user"]`` (how
whet passes the user it serves to MCP servers). A caller that names no user (the server run
alone, under a desktop client) acts for the user "default", whet's own default user when it runs
without API keys: one person's whet and desktop client share that notebook, and notes written
before users existed belong to it. Ids are shared across
users but an id of another user's note answers exactly as an unknown id does, so nothing of one
user is visible to another. ``whet_forget_user`` deletes every note of the calling user; whet
calls it when a user is forgotten and never shows it to a model.

The server runs sync tools in worker threads, so the one connection is shared behind a
lock; WAL lets other processes read the file while this one writes. Ids come from
AUTOINCREMENT so a deleted note's id is never reused: an id a model remembers can never
come to mean a different note.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import threading
import weakref
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Literal

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import BaseModel, Field

DEFAULT_LIST = "inbox"
DEFAULT_DB_PATH = "~/.local/share/whet/notes.db"
USER_META_KEY = "whet/user"  # the request _meta key whet sends the calling user under
FORGET_TOOL = "whet_forget_user"
# the namespace of callers that name no user; the same name as whet's default user (server.default_user),
# so a single-user whet and a desktop client on the same notebook share it, and notes from before users
STANDALONE_OWNER = "default"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS notes (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    text TEXT NOT NULL,
    list TEXT NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('note', 'todo')),
    created_at TEXT NOT NULL,
    completed_at TEXT,
    owner TEXT NOT NULL DEFAULT 'default'
);
"""
_OWNER_INDEX = "CREATE INDEX IF NOT EXISTS notes_by_owner ON notes (owner, list, kind)"
_COLUMNS = "id, text, list, kind, created_at, completed_at"

Kind = Literal["note", "todo"]


class NoteError(ToolError):
    """A request the notebook cannot honour (unknown id, empty text, ...); tools answer it as isError."""


class Note(BaseModel):
    id: int
    text: str
    list: str
    kind: Kind
    done: bool = Field(description="True for a completed todo; always False for a note.")
    created_at: str
    completed_at: str | None


class NoteList(BaseModel):
    count: int
    truncated: bool = Field(description="True when more matched than the limit; narrow or raise it.")
    notes: list[Note]


class Deleted(BaseModel):
    deleted: Note


class Forgotten(BaseModel):
    user: str
    deleted: int = Field(description="How many notes and todos were deleted.")


def named_user(ctx: Context | None) -> str | None:
    """The user named in the request's ``_meta["whet/user"]``, if any (none outside a request)."""
    try:
        meta = ctx.request_context.meta if ctx is not None else None
    except ValueError:  # called in-process without a request (e.g. MCPServer.call_tool directly)
        meta = None
    user = (meta or {}).get(USER_META_KEY)
    return user if isinstance(user, str) and user else None


def caller(ctx: Context | None) -> str:
    """The user a request acts for: the one it names, else the standalone namespace."""
    return named_user(ctx) or STANDALONE_OWNER


def _list_name(name: str) -> str:
    return " ".join(name.split()).casefold() or DEFAULT_LIST


def _casefold(text: str | None) -> str | None:
    return None if text is None else text.casefold()


def _note(row: tuple) -> Note:
    note_id, text, list_name, kind, created_at, completed_at = row
    done = completed_at is not None
    return Note(id=note_id, text=text, list=list_name, kind=kind, done=done, created_at=created_at,
                completed_at=completed_at)


def _utc_now() -> datetime:
    return datetime.now(UTC)


class NoteBook:
    """The notes table behind one locked connection. Methods raise NoteError for caller mistakes."""

    def __init__(self, db_path: str | Path, now: Callable[[], datetime] = _utc_now) -> None:
        self._now = now
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(db_path), check_same_thread=False, timeout=10.0)
        self._db.create_function("casefold", 1, _casefold, deterministic=True)
        self._db.execute("PRAGMA journal_mode=WAL")  # a no-op answer of "memory" for ":memory:"
        with self._lock, self._db:
            self._db.executescript(_SCHEMA)
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(notes)")}
            if "owner" not in columns:  # a notebook from before users: its notes go to the standalone namespace
                self._db.execute("ALTER TABLE notes ADD COLUMN owner TEXT NOT NULL DEFAULT 'default'")
            self._db.execute(_OWNER_INDEX)

    def _stamp(self) -> str:
        return self._now().astimezone(UTC).isoformat(timespec="seconds")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def add(self, owner: str, text: str, list_name: str, kind: Kind) -> Note:
        body = text.strip()
        if not body:
            raise NoteError("The text is empty; give the note or todo some words.")
        with self._lock, self._db:
            cursor = self._db.execute(
                "INSERT INTO notes (text, list, kind, created_at, owner) VALUES (?, ?, ?, ?, ?)",
                (body, _list_name(list_name), kind, self._stamp(), owner),
            )
            assert cursor.lastrowid is not None
            return self._get(owner, cursor.lastrowid)

    def find(
        self,
        owner: str,
        words: list[str],
        list_name: str | None,
        kind: Kind | None,
        include_completed: bool,
        limit: int,
    ) -> NoteList:
        """`owner`'s notes matching every filter given, oldest first, at most `limit`; a blank list means all."""
        clauses, params = ["owner = ?"], [owner]
        clauses += ["instr(casefold(text), ?) > 0" for _ in words]
        params += [w.casefold() for w in words]
        if list_name is not None and list_name.strip():
            clauses.append("list = ?")
            params.append(_list_name(list_name))
        if kind is not None:
            clauses.append("kind = ?")
            params.append(kind)
        if not include_completed:
            clauses.append("completed_at IS NULL")
        where = f"WHERE {' AND '.join(clauses)}"
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM notes {where} ORDER BY id LIMIT ?", (*params, limit + 1)
            ).fetchall()
        notes = [_note(row) for row in rows[:limit]]
        return NoteList(count=len(notes), truncated=len(rows) > limit, notes=notes)

    def complete(self, owner: str, note_id: int) -> Note:
        """Mark a todo done; completing a done todo again changes nothing."""
        with self._lock, self._db:
            note = self._get(owner, note_id)
            if note.kind != "todo":
                raise NoteError(f"Item {note_id} is a note, not a todo, so it cannot be completed.")
            if not note.done:
                self._db.execute("UPDATE notes SET completed_at = ? WHERE id = ?", (self._stamp(), note_id))
            return self._get(owner, note_id)

    def delete(self, owner: str, note_id: int) -> Note:
        with self._lock, self._db:
            note = self._get(owner, note_id)
            self._db.execute("DELETE FROM notes WHERE id = ?", (note_id,))
            return note

    def forget(self, owner: str) -> int:
        """Delete every note and todo of `owner`; returns how many."""
        with self._lock, self._db:
            return self._db.execute("DELETE FROM notes WHERE owner = ?", (owner,)).rowcount

    def _get(self, owner: str, note_id: int) -> Note:
        row = self._db.execute(
            f"SELECT {_COLUMNS} FROM notes WHERE id = ? AND owner = ?", (note_id, owner)
        ).fetchone()
        if row is None:
            raise NoteError(f"There is no note or todo with id {note_id}; list_notes shows the ids.")
        return _note(row)


def _annotations(*, read_only: bool, destructive: bool, idempotent: bool) -> ToolAnnotations:
    return ToolAnnotations(
        readOnlyHint=read_only, destructiveHint=destructive, idempotentHint=idempotent, openWorldHint=False
    )


_ADDS = _annotations(read_only=False, destructive=False, idempotent=False)
_READS = _annotations(read_only=True, destructive=False, idempotent=True)
_COMPLETES = _annotations(read_only=False, destructive=False, idempotent=True)
_DELETES = _annotations(read_only=False, destructive=True, idempotent=True)
_ListName = Annotated[str | None, Field(description="Only this list, e.g. 'groceries'; omit for every list.")]
_KindFilter = Annotated[Kind | None, Field(description="Only notes or only todos; omit for both.")]
_Limit = Annotated[int, Field(ge=1, le=500, description="Most items to return.")]
_NoteId = Annotated[int, Field(description="The id shown by add_note, list_notes or search_notes.")]


def build_server(
    db_path: str | Path, now: Callable[[], datetime] = _utc_now, *, forget_tool: bool = False
) -> MCPServer:
    """An MCP server over the notebook at `db_path` (":memory:" for a throwaway one); creates the tables.

    ``forget_tool`` adds ``whet_forget_user`` (the stdio server, `python -m whet.servers.notes`,
    offers it); off by default, so an in-process tool list (the warm-start data's) is what a
    model is shown.
    """
    notebook = NoteBook(db_path, now)
    server = MCPServer(
        "whet-notes",
        instructions="The user's notes and todo lists (groceries, work, ...). Ids identify items for "
        "complete_todo and delete_note.",
    )
    weakref.finalize(server, notebook.close)  # the connection lives exactly as long as the server

    @server.tool(title="Add note or todo", annotations=_ADDS)
    def add_note(
        text: Annotated[str, Field(min_length=1, max_length=10_000, description="What to remember or do.")],
        list_name: Annotated[str, Field(max_length=100, description="e.g. 'groceries'.")] = DEFAULT_LIST,
        kind: Annotated[Kind, Field(description="'todo' for something to do and tick off.")] = "note",
        ctx: Context | None = None,
    ) -> Note:
        """Save a note or a todo in a named list (default 'inbox'). Returns it with its id."""
        return notebook.add(caller(ctx), text, list_name, kind)

    @server.tool(title="List notes", annotations=_READS)
    def list_notes(
        list_name: _ListName = None,
        kind: _KindFilter = None,
        include_completed: bool = False,
        limit: _Limit = 50,
        ctx: Context | None = None,
    ) -> NoteList:
        """List notes and todos, oldest first; completed todos are left out unless include_completed."""
        return notebook.find(caller(ctx), [], list_name, kind, include_completed, limit)

    @server.tool(title="Search notes", annotations=_READS)
    def search_notes(
        query: Annotated[str, Field(min_length=1, description="Words that must all appear in the text.")],
        list_name: _ListName = None,
        kind: _KindFilter = None,
        include_completed: bool = True,
        limit: _Limit = 50,
        ctx: Context | None = None,
    ) -> NoteList:
        """Find notes and todos whose text contains every word of the query, case-insensitively."""
        words = query.split()
        if not words:
            raise NoteError("The query is empty; give at least one word to search for.")
        return notebook.find(caller(ctx), words, list_name, kind, include_completed, limit)

    @server.tool(title="Complete todo", annotations=_COMPLETES)
    def complete_todo(note_id: _NoteId, ctx: Context | None = None) -> Note:
        """Mark a todo as done (it stays stored; list_notes hides it unless include_completed)."""
        return notebook.complete(caller(ctx), note_id)

    @server.tool(title="Delete note or todo", annotations=_DELETES)
    def delete_note(note_id: _NoteId, ctx: Context | None = None) -> Deleted:
        """Delete a note or todo for good by id. Returns what was deleted."""
        return Deleted(deleted=notebook.delete(caller(ctx), note_id))

    if forget_tool:
        _add_forget_tool(server, notebook)
    return server


def _add_forget_tool(server: MCPServer, notebook: NoteBook) -> None:
    @server.tool(name=FORGET_TOOL, title="Forget the calling user", annotations=_DELETES)
    def forget_user(ctx: Context | None = None) -> Forgotten:
        """Delete every note and todo of the user named in the request's _meta (whet/user).

        For the operator's "forget this user"; refused when the request names no user.
        """
        owner = named_user(ctx)
        if owner is None:
            raise NoteError(f"Name the user to forget in the request's _meta['{USER_META_KEY}'].")
        return Forgotten(user=owner, deleted=notebook.forget(owner))


def main() -> None:
    """Serve the notebook at argv[1], else $WHET_NOTES_DB, else ~/.local/share/whet/notes.db, over stdio."""
    path = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("WHET_NOTES_DB", DEFAULT_DB_PATH))
    path = path.expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    build_server(path, forget_tool=True).run("stdio")


if __name__ == "__main__":
    main()
