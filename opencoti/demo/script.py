"""The demo's fixed content: the prompts, the parts of the work, the instructions of the long-running
agent and the review group's tools. The model writes the answers; this file decides who asks what."""

from __future__ import annotations

from langchain_core.tools import tool

SYSTEM_PROMPT = ("You are part of a team of AI agents that plans community events. The lead agent writes a brief "
                 "and splits the work; every sub-agent handles one part and answers in at most three short, "
                 "concrete sentences.")
TASK = ("Plan a one-day community science fair for families in a small town in late spring. "
        "Write a short brief for the team: the goal, the audience and the parts of the work.")
PARTS = ["the schedule of the day", "the venue and its layout", "the budget", "volunteers and their roles",
         "invitations and posters", "safety and first aid", "food and drinks", "access for wheelchair users",
         "the hands-on experiments", "the prizes for young scientists"]
NESTED_PARTS = ["the morning program (9:00 to 12:00)", "the afternoon program (13:00 to 17:00)",
                "the closing ceremony", "the breaks"]
REVIEW_PARTS = ["the safety rules for chemistry demonstrations", "the wording of the invitation letter",
                "the volunteer sign-up form", "the list of prizes"]
LONG_ROLE = ("You are the logistics lead for the science fair. Work through the instructions one at a time and "
             "answer each in a short numbered list.")
LONG_STEPS = ["List the equipment the fair needs.", "Estimate the cost of each item.",
              "Say where each item comes from.", "Write the setup timeline for the morning.",
              "List what can go wrong and the fix for each.", "Write the packing plan for the evening.",
              "Say who is responsible for each item.", "List what is still open.",
              "Write a checklist for the day before.", "Write a one-line status for the lead agent."]


@tool
def check_facts(claim: str) -> str:
    """Check a factual claim in the plan against trusted sources; returns a verdict and a source."""
    return "not implemented in the demo"


@tool
def suggest_edit(section: str, change: str) -> str:
    """Propose an edit to one section of the plan (the editor applies accepted edits)."""
    return "not implemented in the demo"
