//! Where a message may go: subject syntax, the subjects NATS keeps for
//! itself, and the relay's allow-list.
//!
//! A document names its subject, so a document is a way to publish anything
//! the relay's NATS user may publish. Left open, that reaches NATS's own API
//! (`$JS.API.STREAM.DELETE.<stream>` deletes a stream; `_INBOX.<id>` answers
//! another client's request). So the relay publishes only under its subject
//! prefix and to subjects matching the operator's `--allow-subject`
//! patterns, and never to a subject beginning with `$` or `_INBOX`, whatever
//! the patterns say.

use super::template::{SubjectFields, SubjectTemplate};
use super::{ContractViolation, Rule};

/// The longest subject the relay publishes, in characters. A NATS protocol
/// line must fit `max_control_line` (4096 bytes by default) with the reply
/// subject and sizes; 512 characters take at most 2048 bytes of UTF-8.
pub const MAX_SUBJECT_CHARS: usize = 512;

/// Subjects that belong to NATS itself: the system and JetStream APIs
/// (`$SYS.`, `$JS.`, `$KV.`, `$O.`, ...) and request inboxes.
const RESERVED_START: &str = "$";
const INBOX: &str = "_INBOX";

/// The subjects the relay may publish to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubjectRules {
    prefix: String,
    allowed: Vec<String>,
    /// The subject of a message that names none.
    template: SubjectTemplate,
}

impl SubjectRules {
    /// Subjects under `prefix` (the default `<prefix>.<type>` and any
    /// explicit `<prefix>.…`), and nothing else.
    pub fn under(prefix: impl Into<String>) -> Result<Self, ContractViolation> {
        let prefix = prefix.into();
        validate_subject(&prefix)?;
        refuse_reserved(&prefix)?;
        Ok(SubjectRules {
            prefix,
            allowed: Vec::new(),
            template: SubjectTemplate::default(),
        })
    }

    /// Also allows explicit subjects matching `pattern`, a NATS subject
    /// with wildcards (`billing.>`, `audit.*.events`). A pattern that could
    /// only match reserved subjects is refused; reserved subjects stay
    /// refused whatever a pattern matches.
    pub fn allow(mut self, pattern: impl Into<String>) -> Result<Self, ContractViolation> {
        let pattern = pattern.into();
        validate_pattern(&pattern)?;
        self.allowed.push(pattern);
        Ok(self)
    }

    /// Every subject outside NATS's reserved space, with the default prefix.
    pub(crate) fn anything_unreserved() -> Self {
        SubjectRules {
            prefix: super::DEFAULT_SUBJECT_PREFIX.to_owned(),
            allowed: vec![">".to_owned()],
            template: SubjectTemplate::default(),
        }
    }

    /// Renders the subjects of messages that name none with `template`.
    /// Refused unless every subject it can render is under the prefix or
    /// matches one allowed pattern (a key or a header is one token, a type
    /// one or more), and its literal tokens are a subject's; call it after
    /// [`allow`](Self::allow). A message's rendered subject is still
    /// checked as any subject (a type or key may make it reserved).
    pub fn with_template(mut self, template: SubjectTemplate) -> Result<Self, ContractViolation> {
        let unusable = |violation: ContractViolation| {
            ContractViolation::new(
                violation.rule(),
                format!(
                    "the subject template {:?} cannot be used: {violation}",
                    template.as_str()
                ),
            )
        };
        let example = template.example(&self.prefix);
        validate_subject(&example).map_err(unusable)?;
        refuse_reserved(&example).map_err(unusable)?;
        let pattern = template.pattern(&self.prefix);
        if !self.permits_all(&pattern) {
            return Err(ContractViolation::new(
                Rule::SubjectNotAllowed,
                format!(
                    "the subject template {:?} gives subjects {pattern:?} (a key or a header \
                     one token, a type one or more), not all of them under \"{}.\" or matching \
                     an --allow-subject pattern; allow them with --allow-subject '{pattern}'",
                    template.as_str(),
                    self.prefix
                ),
            ));
        }
        self.template = template;
        Ok(self)
    }

    /// The subject template.
    pub fn template(&self) -> &SubjectTemplate {
        &self.template
    }

    /// The subject prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The allow-list's patterns.
    pub fn allowed(&self) -> &[String] {
        &self.allowed
    }

    /// `<prefix>.<type>`: a subject every type must be able to end, so
    /// that one type means one thing under any template.
    pub fn type_subject(&self, message_type: &str) -> String {
        format!("{}.{message_type}", self.prefix)
    }

    /// The subject of a message that names none, rendered from the
    /// template and checked as any subject is.
    pub fn subject_of(
        &self,
        message_type: &str,
        key: Option<&str>,
        headers: &[(String, String)],
    ) -> Result<String, ContractViolation> {
        let subject = self.template.render(&SubjectFields {
            prefix: &self.prefix,
            message_type,
            key,
            headers,
        })?;
        self.check(&subject)?;
        Ok(subject)
    }

    /// Checks a subject the relay is asked to publish to: valid syntax, not
    /// reserved, not too long, and under the prefix or allowed.
    pub fn check(&self, subject: &str) -> Result<(), ContractViolation> {
        validate_subject(subject)?;
        refuse_reserved(subject)?;
        if self.permits(subject) {
            return Ok(());
        }
        Err(ContractViolation::new(
            Rule::SubjectNotAllowed,
            format!(
                "subject {subject:?} is outside what this relay publishes to: it must begin with \
             \"{}.\"{}; an operator may allow more with --allow-subject PATTERN",
                self.prefix,
                match self.allowed.as_slice() {
                    [] => String::new(),
                    patterns => format!(" or match one of {patterns:?}"),
                }
            ),
        ))
    }

    /// Checks a prefix that other subjects are to be sent under (a
    /// replay's `--replay-prefix`): valid syntax, not reserved, and every
    /// subject under it under the relay's prefix or allowed by one pattern
    /// (`<prefix>.>`, or a pattern ending in `>` that covers it).
    pub fn check_prefix(&self, prefix: &str) -> Result<(), ContractViolation> {
        validate_subject(prefix)?;
        refuse_reserved(prefix)?;
        if self.permits_all(&format!("{prefix}.>")) {
            return Ok(());
        }
        Err(ContractViolation::new(
            Rule::SubjectNotAllowed,
            format!(
            "not every subject under {prefix:?} is one this relay publishes to: the prefix must \
             begin with \"{}.\", or an operator must allow its subjects with --allow-subject \
             '{prefix}.>'",
            self.prefix
        ),
        ))
    }

    /// Whether every subject `pattern` matches is under the prefix or
    /// matches one allowed pattern.
    fn permits_all(&self, pattern: &str) -> bool {
        let own = format!("{}.>", self.prefix);
        std::iter::once(&own)
            .chain(&self.allowed)
            .any(|allowed| pattern_covers(allowed, pattern))
    }

    fn permits(&self, subject: &str) -> bool {
        let under_prefix = subject
            .strip_prefix(self.prefix.as_str())
            .is_some_and(|rest| rest.starts_with('.'));
        under_prefix
            || self
                .allowed
                .iter()
                .any(|pattern| pattern_matches(pattern, subject))
    }

    /// Regular expressions (PCRE, as `$jsonSchema` reads them) of which a
    /// subject must match at least one: the prefix, then each pattern.
    pub(crate) fn permitted_regexes(&self) -> Vec<String> {
        std::iter::once(format!("^{}\\.", regex_escape(&self.prefix)))
            .chain(self.allowed.iter().map(|p| pattern_regex(p)))
            .collect()
    }
}

/// Checks a subject's syntax: dot-separated tokens, none empty, no
/// spaces or control characters, no wildcards (`*`, `>`, which NATS
/// would read as a pattern), and at most [`MAX_SUBJECT_CHARS`] characters.
pub fn validate_subject(subject: &str) -> Result<(), ContractViolation> {
    let bad = |why: String| {
        Err(ContractViolation::new(
            Rule::Subject,
            format!("invalid subject {}: {why}", shown(subject)),
        ))
    };
    if subject.is_empty() {
        return bad("it is empty".into());
    }
    let chars = subject.chars().count();
    if chars > MAX_SUBJECT_CHARS {
        return bad(format!(
            "it is {chars} characters long; the limit is {MAX_SUBJECT_CHARS}"
        ));
    }
    if subject.split('.').any(str::is_empty) {
        return bad("it has an empty token (leading, trailing or doubled '.')".into());
    }
    // Spaces and control characters (tabs and line breaks among them) end
    // a subject in the NATS protocol; other Unicode is carried as is.
    if subject.chars().any(|c| c == ' ' || c.is_control()) {
        return bad("it contains a space or a control character".into());
    }
    if subject.contains(['*', '>']) {
        return bad("it contains a wildcard ('*' or '>')".into());
    }
    Ok(())
}

/// Refuses the subjects NATS keeps for itself.
fn refuse_reserved(subject: &str) -> Result<(), ContractViolation> {
    let first = subject.split('.').next().unwrap_or_default();
    if subject.starts_with(RESERVED_START) || first == INBOX {
        return Err(ContractViolation::new(
            Rule::ReservedSubject,
            format!(
            "subject {} is reserved to NATS (subjects beginning with '$' or '_INBOX' reach the \
             server's own APIs and other clients' replies); the relay never publishes there",
            shown(subject)
        ),
        ));
    }
    Ok(())
}

/// Checks an allow-list pattern: subject syntax where a token may be `*`
/// and the last may be `>`, not beginning in NATS's reserved space.
pub(crate) fn validate_pattern(pattern: &str) -> Result<(), ContractViolation> {
    let bad = |why: &str| {
        Err(ContractViolation::new(
            Rule::Subject,
            format!("invalid subject pattern {pattern:?}: {why}"),
        ))
    };
    let tokens: Vec<&str> = pattern.split('.').collect();
    for (n, token) in tokens.iter().enumerate() {
        let last = n + 1 == tokens.len();
        let wildcard = *token == "*" || (*token == ">" && last);
        if !wildcard && validate_subject(token).is_err() {
            return bad(
                "each token must be '*', a final '>', or a literal without '.', '*', \
                 '>', spaces or control characters",
            );
        }
    }
    if pattern.chars().count() > MAX_SUBJECT_CHARS {
        return bad("it is too long");
    }
    let first = tokens.first().copied().unwrap_or_default();
    if first.starts_with(RESERVED_START) || first == INBOX {
        return bad("it names NATS's reserved subjects ('$…', '_INBOX…'), which are never allowed");
    }
    Ok(())
}

/// Whether `subject` matches a NATS `pattern` (`*` one token, a final `>`
/// one or more).
pub fn pattern_matches(pattern: &str, subject: &str) -> bool {
    let mut subject_tokens = subject.split('.');
    for token in pattern.split('.') {
        if token == ">" {
            return subject_tokens.next().is_some();
        }
        match subject_tokens.next() {
            Some(s) if token == "*" || token == s => {}
            _ => return false,
        }
    }
    subject_tokens.next().is_none()
}

/// Whether every subject `pattern` matches is matched by `allowed` (both
/// NATS patterns).
fn pattern_covers(allowed: &str, pattern: &str) -> bool {
    let wanted: Vec<&str> = pattern.split('.').collect();
    let tokens: Vec<&str> = allowed.split('.').collect();
    for (n, token) in tokens.iter().enumerate() {
        match (*token, wanted.get(n).copied()) {
            (">", Some(_)) => return true,
            (_, None) | (_, Some(">")) => return false,
            ("*", Some(_)) => {}
            (literal, Some(own)) if literal == own && own != "*" => {}
            _ => return false,
        }
    }
    tokens.len() == wanted.len()
}

/// A NATS pattern as an anchored regular expression.
pub(crate) fn pattern_regex(pattern: &str) -> String {
    let tokens: Vec<String> = pattern
        .split('.')
        .map(|token| match token {
            "*" => "[^.]+".to_owned(),
            ">" => ".+".to_owned(),
            literal => regex_escape(literal),
        })
        .collect();
    format!("^{}$", tokens.join("\\."))
}

fn regex_escape(literal: &str) -> String {
    let mut escaped = String::with_capacity(literal.len());
    for c in literal.chars() {
        if c.is_ascii_punctuation() {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

/// A subject for an error message, cut short if long.
pub(crate) fn shown(subject: &str) -> String {
    const SHOWN: usize = 80;
    if subject.chars().count() <= SHOWN {
        return format!("{subject:?}");
    }
    let head: String = subject.chars().take(SHOWN).collect();
    format!("{head:?}… ({} characters)", subject.chars().count())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::SubjectTemplate;

    fn rules() -> SubjectRules {
        SubjectRules::under("outbox")
            .and_then(|r| r.allow("billing.>"))
            .and_then(|r| r.allow("audit.*.events"))
            .expect("valid rules")
    }

    #[test]
    fn a_replay_prefix_must_have_every_subject_under_it_allowed() {
        let rules = rules()
            .allow("replay.*.>")
            .and_then(|r| r.allow("narrow.orders.*"))
            .expect("valid rules");
        for good in [
            "outbox.replay",
            "billing",
            "billing.again",
            "replay.x",
            "replay.x.y",
        ] {
            assert!(rules.check_prefix(good).is_ok(), "{good}");
        }
        for bad in [
            "replay",
            "narrow.orders",
            "narrow",
            "audit.x",
            "elsewhere",
            "$JS.API",
            "_INBOX",
        ] {
            assert!(rules.check_prefix(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn prefix_and_allow_list_decide() {
        let rules = rules();
        for good in [
            "outbox.a",
            "outbox.order.placed",
            "billing.invoice",
            "billing.a.b",
            "audit.x.events",
        ] {
            assert!(rules.check(good).is_ok(), "{good}");
        }
        for bad in [
            "outboxes.a",
            "outbox",
            "billing",
            "audit.x.y.events",
            "audit.events",
            "other.x",
        ] {
            let error = rules.check(bad).unwrap_err().to_string();
            assert!(error.contains("--allow-subject"), "{bad}: {error}");
        }
    }

    #[test]
    fn reserved_subjects_are_refused_whatever_is_allowed() {
        let everything = SubjectRules::under("outbox")
            .and_then(|r| r.allow(">"))
            .and_then(|r| r.allow("*.>"))
            .expect("valid rules");
        for reserved in [
            "$JS.API.STREAM.DELETE.ORDERS",
            "$KV.bucket.key",
            "$O.store.x",
            "$SYS.REQ.SERVER.PING",
            "$G",
            "_INBOX.abc.1",
            "_INBOX",
        ] {
            let error = everything.check(reserved).unwrap_err().to_string();
            assert!(error.contains("reserved to NATS"), "{reserved}: {error}");
        }
        assert!(everything.check("_INBOXES.x").is_ok());
        assert!(everything.check("x.$JS.y").is_ok());
    }

    #[test]
    fn subjects_have_a_length_limit() {
        let rules = SubjectRules::under("outbox").expect("rules");
        let longest = format!("outbox.{}", "a".repeat(MAX_SUBJECT_CHARS - 7));
        assert!(rules.check(&longest).is_ok());
        let error = rules.check(&format!("{longest}b")).unwrap_err().to_string();
        assert!(error.contains("limit is 512"), "{error}");
        assert!(
            error.len() < 400,
            "the error quotes the subject whole: {error}"
        );
    }

    #[test]
    fn patterns_are_checked() {
        for good in [">", "*", "a.*.c", "a.>", "billing.invoice"] {
            assert!(validate_pattern(good).is_ok(), "{good}");
        }
        for bad in [
            "", "a..b", "a.>.b", "a*", "a.b>", "$JS.>", "_INBOX.>", "a b", "$SYS",
        ] {
            assert!(validate_pattern(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_template_must_render_only_permitted_subjects() {
        let rules = |allowed: &[&str]| {
            allowed
                .iter()
                .try_fold(SubjectRules::under("shop").expect("rules"), |rules, p| {
                    rules.allow(*p)
                })
                .expect("rules")
        };
        let parse = |text: &str| SubjectTemplate::parse(text).expect("a template");
        for (allowed, template) in [
            (&[][..], "{prefix}.{type}.{key}"),
            (&[][..], "shop.{key}"),
            (&["acme.>"][..], "acme.{header.Tenant}.{type}"),
            (&["orders.*"][..], "orders.{key}"),
            (&["*.x"][..], "{key}.x"),
        ] {
            let template = parse(template);
            let shown = template.as_str().to_owned();
            assert!(rules(allowed).with_template(template).is_ok(), "{shown}");
        }
        for (allowed, template, saying) in [
            (&[][..], "orders.{key}", "--allow-subject 'orders.*'"),
            (&["order.*"][..], "{type}", "--allow-subject '>'"),
            (&["billing.>"][..], "{type}", "--allow-subject '>'"),
            (&["orders.*"][..], "orders.{type}", "'orders.>'"),
            (&["orders.x"][..], "orders.{key}", "'orders.*'"),
            (&[">"][..], "$JS.API.{key}", "reserved to NATS"),
            (&[">"][..], "_INBOX.{key}", "reserved to NATS"),
            (&[">"][..], "a.*.{key}", "wildcard"),
            (&[][..], "{prefix}..{key}", "empty token"),
            (&[][..], "", "empty"),
        ] {
            let error = rules(allowed).with_template(parse(template)).unwrap_err();
            assert!(error.to_string().contains(saying), "{template}: {error}");
        }
    }

    #[test]
    fn wildcards_match_as_nats_does() {
        assert!(pattern_matches("a.*", "a.b"));
        assert!(!pattern_matches("a.*", "a.b.c"));
        assert!(pattern_matches("a.>", "a.b.c"));
        assert!(!pattern_matches("a.>", "a"));
        assert!(pattern_matches(">", "x"));
        assert!(!pattern_matches("a.b", "a.b.c"));
        assert!(!pattern_matches("a.b.c", "a.b"));
    }

    #[test]
    fn pattern_regexes_escape_literals() {
        assert_eq!(pattern_regex("a-b.*.>"), "^a\\-b\\.[^.]+\\..+$");
        assert_eq!(
            rules().permitted_regexes()[0],
            "^outbox\\.",
            "the prefix is matched with its dot"
        );
    }
}
