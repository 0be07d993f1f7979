"""The HTML pages: the spend dashboard, the one sign-in flow, shared page plumbing, templates."""
