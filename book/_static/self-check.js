/* Self-checks (book/_ext/self_check.py): answer on the page, see at once whether the answer is right.
   A choice question: each lettered choice becomes a button inside its list item. A number question: an
   input box and a Check button; the answer counts as right within the question's relative tolerance of the
   exact value or of the value as shown. A right answer opens the answer-and-why block; a wrong one says so
   and leaves it closed. Everything works from the keyboard alone (Tab to a choice, Enter or Space to choose
   it; type a number, Enter to check it), and the verdict is a status line that screen readers announce.
   Everything runs on the page: nothing is fetched. */
(function () {
  "use strict";

  function say(box, text, verdict) {
    const line = box.querySelector(".self-check-feedback");
    line.textContent = text;
    line.dataset.verdict = verdict;
    if (verdict === "right") box.querySelector("details.self-check-answer").open = true;
  }

  /* Each choice's paragraph moves into a button, after its letter: the list keeps its items, and the
     button is named by what it shows ("B. one"). */
  function setUpChoices(box) {
    const right = Number(box.dataset.answer);
    const list = box.querySelector("ol.self-check-choices");
    list.classList.add("self-check-buttons");
    const items = [...list.children];
    items.forEach((item, i) => {
      const letter = String.fromCharCode(65 + i);
      const button = document.createElement("button");
      button.type = "button";
      button.className = "self-check-choice";
      const mark = document.createElement("span");
      mark.className = "self-check-letter";
      mark.textContent = `${letter}.`;
      const text = item.querySelector(":scope > p") || item;  // the directive makes each choice one paragraph
      button.append(mark, " ", ...text.childNodes);
      item.replaceChildren(button);
      button.addEventListener("click", () => {
        items.forEach(other => other.classList.remove("self-check-right", "self-check-wrong"));
        const ok = i + 1 === right;
        item.classList.add(ok ? "self-check-right" : "self-check-wrong");
        say(box, ok ? "Right." : `Not this one (${letter}): try another, or show the answer.`, ok ? "right" : "wrong");
      });
    });
  }

  /* "1,024", "1 024", "1e3" and "0.5" are numbers; anything else is not (NaN). */
  function parseNumber(text) {
    const cleaned = text.trim().replace(/[,\s_]/g, "");
    return /^[-+]?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$/i.test(cleaned) ? Number(cleaned) : NaN;
  }

  function setUpNumber(box) {
    const exact = Number(box.dataset.value), shown = Number(box.dataset.shown);
    const tolerance = Number(box.dataset.tolerance);
    const form = document.createElement("form");
    form.className = "self-check-form";
    const input = document.createElement("input");
    input.type = "text";
    input.inputMode = "decimal";
    input.autocomplete = "off";
    input.setAttribute("aria-label", box.dataset.unit ? `Your answer, in ${box.dataset.unit}` : "Your answer");
    input.setAttribute("aria-describedby", box.querySelector(".self-check-question").id);
    const unit = document.createElement("span");
    unit.className = "self-check-unit";
    unit.textContent = box.dataset.unit || "";
    const check = document.createElement("button");
    check.type = "submit";
    check.textContent = "Check";
    form.append(input, unit, check);
    form.addEventListener("submit", e => {
      e.preventDefault();
      const x = parseNumber(input.value);
      if (Number.isNaN(x)) { say(box, "Enter a number, such as 12.5 or 1e3.", "none"); return; }
      const near = v => Math.abs(x - v) <= tolerance * Math.abs(v);
      const ok = near(exact) || near(shown);
      box.classList.toggle("self-check-right", ok);
      box.classList.toggle("self-check-wrong", !ok);
      // the number typed is part of the message, so that a second wrong try is announced too
      say(box, ok ? "Right." : `Not quite: ${input.value.trim()} is ${x > exact ? "too high" : "too low"}. `
          + "Try again, or show the answer.", ok ? "right" : "wrong");
    });
    box.querySelector(".self-check-question").after(form);
  }

  function setUp(box, n) {
    box.querySelector(".self-check-question").id ||= `self-check-question-${n + 1}`;
    const feedback = document.createElement("p");
    feedback.className = "self-check-feedback";
    feedback.setAttribute("role", "status");  // a polite live region: the verdict is read out when it changes
    feedback.setAttribute("aria-live", "polite");
    box.querySelector("details.self-check-answer").before(feedback);
    if (box.dataset.kind === "choice") setUpChoices(box);
    else if (box.dataset.kind === "number") setUpNumber(box);
  }

  function setUpAll() { document.querySelectorAll("div.self-check").forEach(setUp); }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", setUpAll);
  else setUpAll();
})();
