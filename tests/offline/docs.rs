//! Every relative link in README and docs/ reaches a file that exists and,
//! where it names one, a heading that exists: moving a section must not
//! leave a reader at a dead end.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The markdown files readers start from.
fn documents() -> Vec<PathBuf> {
    let root = root();
    let mut files = vec![root.join("README.md"), root.join("BENCHMARKS.md")];
    let docs = std::fs::read_dir(root.join("docs")).expect("read docs/");
    let mut guides: Vec<PathBuf> = docs
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    guides.sort();
    files.extend(guides);
    files
}

/// The file's lines with fenced code blocks blanked out.
fn prose_lines(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut in_fence = false;
    text.lines()
        .map(|line| {
            let fence = line.trim_start().starts_with("```");
            if fence {
                in_fence = !in_fence;
            }
            if fence || in_fence {
                String::new()
            } else {
                without_code_spans(line)
            }
        })
        .collect()
}

/// A line with its code spans blanked out, so that `[x](y)` in code is not
/// read as a link.
fn without_code_spans(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
            out.push(' ');
        } else {
            out.push(if in_code { ' ' } else { c });
        }
    }
    out
}

/// GitHub's anchor for a heading: lower case, spaces to '-', punctuation
/// other than '-' and '_' dropped; repeats get -1, -2, ...
fn anchors(path: &Path) -> HashSet<String> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut anchors = HashSet::new();
    let mut in_fence = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        let Some(heading) = line.strip_prefix('#') else {
            continue;
        };
        if in_fence {
            continue;
        }
        let title = heading.trim_start_matches('#').trim();
        let title = link_texts(title);
        let slug: String = title
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let count = seen.entry(slug.clone()).or_insert(0);
        anchors.insert(match *count {
            0 => slug,
            n => format!("{slug}-{n}"),
        });
        *count += 1;
    }
    anchors
}

/// A heading's text as rendered: `[text](target)` becomes `text`.
fn link_texts(title: &str) -> String {
    let mut out = String::new();
    let mut rest = title;
    while let Some(open) = rest.find('[') {
        let Some(close) = rest[open..].find("](").map(|i| open + i) else {
            break;
        };
        let Some(end) = rest[close..].find(')').map(|i| close + i) else {
            break;
        };
        out.push_str(&rest[..open]);
        out.push_str(&rest[open + 1..close]);
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

/// Every inline link's target in a line: what follows `](` up to `)`.
fn targets(line: &str) -> Vec<String> {
    line.match_indices("](")
        .filter_map(|(at, _)| {
            let rest = &line[at + 2..];
            rest.find([')', ' ']).map(|end| rest[..end].to_owned())
        })
        .collect()
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let mut problems = Vec::new();
    let mut checked = 0;
    for source in documents() {
        for (number, line) in prose_lines(&source).iter().enumerate() {
            for target in targets(line) {
                if target.starts_with("http://") || target.starts_with("https://") {
                    continue;
                }
                checked += 1;
                let (file, anchor) = target.split_once('#').unwrap_or((&target, ""));
                let dest = match file {
                    "" => source.clone(),
                    file => source.parent().expect("a folder").join(file),
                };
                let place = format!("{}:{}: {target}", source.display(), number + 1);
                if !dest.exists() {
                    problems.push(format!("{place}: no such file"));
                } else if !anchor.is_empty() && !anchors(&dest).contains(anchor) {
                    problems.push(format!("{place}: no such heading"));
                }
            }
        }
    }
    assert!(
        problems.is_empty(),
        "broken links:\n{}",
        problems.join("\n")
    );
    assert!(
        checked > 20,
        "only {checked} links found: is the parser blind?"
    );
}

#[test]
fn the_checker_sees_a_broken_anchor() {
    let readme = root().join("README.md");
    assert!(anchors(&readme).contains("running-it"));
    assert!(anchors(&readme).contains("the-outbox-document"));
    assert!(!anchors(&readme).contains("no-such-section"));
    assert_eq!(
        targets("see [checks](docs/operating.md#start-up-checks) and [x](y)"),
        ["docs/operating.md#start-up-checks", "y"]
    );
}

/// README is for a reader's first hour and BENCHMARKS.md a report of the
/// current code; their details belong in docs/.
#[test]
fn the_front_documents_stay_short() {
    for (name, most) in [("README.md", 350), ("BENCHMARKS.md", 250)] {
        let path = root().join(name);
        let lines = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .lines()
            .count();
        assert!(lines <= most, "{name} has {lines} lines, more than {most}");
    }
}

/// The code spans of a line outside fenced blocks.
fn code_spans(line: &str) -> Vec<&str> {
    line.split('`').skip(1).step_by(2).collect()
}

/// The project paths a document names in code spans (`src/…`, `tests/…`):
/// a file moved or split must not leave a reader looking for it.
#[test]
fn every_project_path_named_in_the_documents_exists() {
    let roots = ["src/", "tests/", "benches/", "scripts/", "docs/"];
    let (mut problems, mut checked) = (Vec::new(), 0);
    for source in documents() {
        let text = std::fs::read_to_string(&source).expect("a document");
        let mut in_fence = false;
        for (number, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("```") {
                in_fence = !in_fence;
            }
            if in_fence {
                continue;
            }
            for span in code_spans(line) {
                let path = span.split_whitespace().next().unwrap_or_default();
                let path = path.split(':').next().unwrap_or_default();
                if !roots.iter().any(|root| path.starts_with(root)) || path.contains(['*', '<']) {
                    continue;
                }
                checked += 1;
                if !root().join(path).exists() {
                    let place = format!("{}:{}", source.display(), number + 1);
                    problems.push(format!("{place}: {path}: no such file or folder"));
                }
            }
        }
    }
    assert!(problems.is_empty(), "stale paths:\n{}", problems.join("\n"));
    assert!(
        checked > 10,
        "only {checked} paths found: is the parser blind?"
    );
}

/// The Rust code blocks of a markdown text.
fn rust_blocks(text: &str) -> Vec<String> {
    let (mut blocks, mut current): (Vec<String>, Option<String>) = (Vec::new(), None);
    for line in text.lines() {
        let fence = line.trim_start();
        match &mut current {
            None if fence.starts_with("```rust") => current = Some(String::new()),
            Some(block) if fence.starts_with("```") => {
                blocks.push(std::mem::take(block));
                current = None;
            }
            Some(block) => {
                block.push_str(line);
                block.push('\n');
            }
            None => {}
        }
    }
    blocks
}

/// The tokens of Rust code, comments left out: words, string literals
/// whole, each other character alone; a comma before a closing bracket
/// dropped, since rustfmt adds one where a line breaks. So a snippet laid
/// out for a page matches the same code as rustfmt lays it out, and
/// nothing else (`let mut s` is not `let muts`).
fn tokens(code: &str) -> Vec<String> {
    let chars: Vec<char> = code.chars().collect();
    let word = |c: char| c.is_alphanumeric() || c == '_';
    let (mut tokens, mut at): (Vec<String>, usize) = (Vec::new(), 0);
    while let Some(&c) = chars.get(at) {
        let start = at;
        at += 1;
        if c.is_whitespace() {
            continue;
        } else if c == '/' && chars.get(at) == Some(&'/') {
            while chars.get(at).is_some_and(|&c| c != '\n') {
                at += 1;
            }
            continue;
        } else if word(c) {
            while chars.get(at).is_some_and(|&c| word(c)) {
                at += 1;
            }
        } else if c == '"' {
            while let Some(&c) = chars.get(at) {
                at += if c == '\\' { 2 } else { 1 };
                if c == '"' {
                    break;
                }
            }
        }
        let token: String = chars[start..at.min(chars.len())].iter().collect();
        if matches!(token.as_str(), ")" | "]" | "}") && tokens.last().is_some_and(|t| t == ",") {
            tokens.pop();
        }
        tokens.push(token);
    }
    tokens
}

/// Every Rust snippet in the documents is code that compiles: it appears,
/// token for token, in a compiled example (`examples/readme.rs`).
#[test]
fn every_rust_snippet_is_compiled_in_an_example() {
    let examples: Vec<Vec<String>> = std::fs::read_dir(root().join("examples"))
        .expect("examples/")
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "rs"))
        .map(|path| tokens(&std::fs::read_to_string(path).expect("an example")))
        .collect();
    let mut snippets = 0;
    for source in documents() {
        let text = std::fs::read_to_string(&source).expect("a document");
        for block in rust_blocks(&text) {
            snippets += 1;
            let code = tokens(&block);
            assert!(
                examples
                    .iter()
                    .any(|example| example.windows(code.len()).any(|run| run == code)),
                "{}: a Rust snippet that no example compiles; put it in examples/readme.rs:\n{block}",
                source.display()
            );
        }
    }
    assert!(
        snippets >= 2,
        "only {snippets} Rust snippets found: is the parser blind?"
    );
}

#[test]
fn the_snippet_check_sees_words_run_together_and_code_in_comments() {
    let example = tokens("let mut session = s; // Outbox::new(&db)\nf(a, b,\n);");
    let found = |snippet: &str| {
        let snippet = tokens(snippet);
        example.windows(snippet.len()).any(|run| run == snippet)
    };
    assert!(found("let mut session = s;"));
    assert!(found("f(a, b);"), "a trailing comma is layout");
    assert!(!found("let muts ession = s;"));
    assert!(!found("Outbox::new(&db)"), "a comment is not code");
}
