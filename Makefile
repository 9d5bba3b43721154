# MHA Lab: `make book` builds the website, `make test` runs every test.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
A ?=

.PHONY: help book test assignments grade bench serve lint clean

help:
	@echo "make book | test | assignments | grade A=<assignment> | bench | serve | lint | clean"

# (Re)create the virtual environment whenever requirements.txt changes.
$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	touch $(STAMP)

book: $(STAMP)
	$(BIN)/jupyter-book build .

test: $(STAMP)
	status=0; $(BIN)/python -m pytest -q || status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$status

assignments: $(STAMP)
	$(BIN)/nbgrader generate_assignment --force --CourseDirectory.db_assignments='[]' $(if $(A),$(A),--all)

grade: $(STAMP)
	@test -n "$(A)" || { echo "usage: make grade A=<assignment>, e.g. A=ps1_per_head_loop" >&2; exit 2; }
	$(BIN)/python -m mha_lab.grading.batch $(A)

bench: $(STAMP)
	$(BIN)/python -m mha_lab bench

serve: book
	$(BIN)/python -m http.server --directory _build/html 8000

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf _build autograded feedback gradebook.db
