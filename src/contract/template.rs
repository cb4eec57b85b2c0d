//! The subject of a message that names none, rendered from a template
//! (`--subject-template`, `{prefix}.{type}` unless set).
//!
//! A template is a subject whose tokens may be placeholders:
//! - `{prefix}`: the relay's subject prefix, as set;
//! - `{type}`: the message's `type`, as written (it may hold dots: a type
//!   of many tokens ends a subject, as it always has);
//! - `{key}`: the message's `key`;
//! - `{header.NAME}`: the value of the header `NAME` in the document's
//!   `headers` (the name as written there, case and all).
//!
//! A placeholder is a whole token: `orders.{key}` is a template,
//! `orders.o-{key}` is not. The key and header values are the writers'
//! input, and any string may be one, so each becomes exactly one token by
//! a reversible escape ([`subject_token`]): every byte of its UTF-8 but
//! ASCII letters, digits, `-` and `_` is written `%XX`. `o-1001` stays
//! `o-1001`; `a.b` becomes `a%2Eb`; no value can add a token, a wildcard,
//! a space or a `$` at a token's start. A message whose key or header the
//! template needs is refused when it has none, or an empty one
//! ([`Rule::SubjectTemplate`]); a rendered subject is then checked as any
//! other (its length, the prefix and the allow-list), so a key too long for
//! a subject is refused by the subject's rule.

use std::fmt;

use super::{ContractViolation, Rule};

/// The template that gives today's `<prefix>.<type>`.
pub const DEFAULT_SUBJECT_TEMPLATE: &str = "{prefix}.{type}";

/// A parsed subject template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubjectTemplate {
    text: String,
    parts: Vec<Part>,
}

/// One piece of a template, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    /// Written as is (dots included).
    Literal(String),
    Prefix,
    Type,
    Key,
    Header(String),
}

/// What a message offers a template.
#[derive(Debug, Clone, Copy)]
pub struct SubjectFields<'a> {
    pub prefix: &'a str,
    pub message_type: &'a str,
    pub key: Option<&'a str>,
    pub headers: &'a [(String, String)],
}

impl SubjectTemplate {
    /// Reads a template; the error says what is wrong with it.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut parts = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            match rest.find(['{', '}']) {
                Some(0) if rest.starts_with('{') => {
                    let end = rest.find('}').ok_or_else(|| {
                        format!("a '{{' is never closed in {text:?}: placeholders are {PLACES}")
                    })?;
                    parts.push(Part::named(&rest[1..end])?);
                    rest = &rest[end + 1..];
                }
                Some(0) => return Err(format!("a '}}' opens nothing in {text:?}")),
                Some(at) => {
                    parts.push(Part::Literal(rest[..at].to_owned()));
                    rest = &rest[at..];
                }
                None => {
                    parts.push(Part::Literal(rest.to_owned()));
                    rest = "";
                }
            }
        }
        let template = SubjectTemplate {
            text: text.to_owned(),
            parts,
        };
        template.check_whole_tokens()?;
        Ok(template)
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Whether the template names the key: each key then has subjects of
    /// its own.
    pub fn uses_key(&self) -> bool {
        self.parts.contains(&Part::Key)
    }

    /// The header names the template reads.
    pub fn headers(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().filter_map(|part| match part {
            Part::Header(name) => Some(name.as_str()),
            _ => None,
        })
    }

    /// The subject of a message, not yet checked against the subject rules.
    pub fn render(&self, fields: &SubjectFields<'_>) -> Result<String, ContractViolation> {
        let mut subject = String::new();
        for part in &self.parts {
            match part {
                Part::Literal(text) => subject.push_str(text),
                Part::Prefix => subject.push_str(fields.prefix),
                Part::Type => subject.push_str(fields.message_type),
                Part::Key => push_token(&mut subject, fields.key, part, self)?,
                Part::Header(name) => {
                    let value = fields
                        .headers
                        .iter()
                        .find(|(own, _)| own == name)
                        .map(|(_, value)| value.as_str());
                    push_token(&mut subject, value, part, self)?;
                }
            }
        }
        Ok(subject)
    }

    /// The subject a message of type `order.placed` and key `o-1001`,
    /// with every header the template reads set to `value`, would get.
    pub fn example(&self, prefix: &str) -> String {
        let mut subject = String::new();
        for part in &self.parts {
            match part {
                Part::Literal(text) => subject.push_str(text),
                Part::Prefix => subject.push_str(prefix),
                Part::Type => subject.push_str("order.placed"),
                Part::Key => subject.push_str("o-1001"),
                Part::Header(_) => subject.push_str("value"),
            }
        }
        subject
    }

    /// A NATS pattern matching every subject the template renders: a key
    /// or a header is one token (`*`); a type is one or more, so from the
    /// first `{type}` on anything may follow (`>`).
    pub fn pattern(&self, prefix: &str) -> String {
        let mut pattern = String::new();
        for part in &self.parts {
            match part {
                Part::Literal(text) => pattern.push_str(text),
                Part::Prefix => pattern.push_str(prefix),
                Part::Key | Part::Header(_) => pattern.push('*'),
                Part::Type => {
                    pattern.push('>');
                    break;
                }
            }
        }
        pattern
    }

    /// Each placeholder stands alone between dots (or the template's ends).
    fn check_whole_tokens(&self) -> Result<(), String> {
        for (n, part) in self.parts.iter().enumerate() {
            if matches!(part, Part::Literal(_)) {
                continue;
            }
            let before = n.checked_sub(1).and_then(|i| self.parts.get(i));
            let after = self.parts.get(n + 1);
            let apart_before = match before {
                None => true,
                Some(Part::Literal(text)) => text.ends_with('.'),
                Some(_) => false,
            };
            let apart_after = match after {
                None => true,
                Some(Part::Literal(text)) => text.starts_with('.'),
                Some(_) => false,
            };
            if !(apart_before && apart_after) {
                return Err(format!(
                    "in {:?}, {part} must be a whole token, with a '.' or the template's end on \
                     each side",
                    self.text
                ));
            }
        }
        Ok(())
    }
}

impl Default for SubjectTemplate {
    fn default() -> Self {
        SubjectTemplate {
            text: DEFAULT_SUBJECT_TEMPLATE.to_owned(),
            parts: vec![Part::Prefix, Part::Literal(".".to_owned()), Part::Type],
        }
    }
}

impl fmt::Display for SubjectTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// The placeholders, for error messages.
const PLACES: &str = "{prefix}, {type}, {key} and {header.NAME}";

impl Part {
    fn named(name: &str) -> Result<Part, String> {
        match name {
            "prefix" => Ok(Part::Prefix),
            "type" => Ok(Part::Type),
            "key" => Ok(Part::Key),
            _ => match name.strip_prefix("header.") {
                Some(header) if super::is_relays_header(header) => Err(format!(
                    "header {header:?} is the relay's own (every Nats-* and Outbox-* header), and \
                     no document may set it"
                )),
                Some(header) if valid_header_name(header) => Ok(Part::Header(header.to_owned())),
                Some(header) => Err(format!(
                    "{header:?} cannot be a header's name: a name is visible ASCII without ':'"
                )),
                None => Err(format!(
                    "{{{name}}} is no placeholder: placeholders are {PLACES}"
                )),
            },
        }
    }
}

impl fmt::Display for Part {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Part::Literal(text) => f.write_str(text),
            Part::Prefix => f.write_str("{prefix}"),
            Part::Type => f.write_str("{type}"),
            Part::Key => f.write_str("{key}"),
            Part::Header(name) => write!(f, "{{header.{name}}}"),
        }
    }
}

fn valid_header_name(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_graphic() && b != b':')
}

/// Appends `value` as one token, or refuses the message that lacks it.
fn push_token(
    subject: &mut String,
    value: Option<&str>,
    part: &Part,
    template: &SubjectTemplate,
) -> Result<(), ContractViolation> {
    match value {
        Some(value) if !value.is_empty() => {
            subject.push_str(&subject_token(value));
            Ok(())
        }
        missing => Err(ContractViolation::new(
            Rule::SubjectTemplate,
            format!(
                "the subject template {:?} needs {}, and the message has {}; give it one, or a \
                 subject of its own",
                template.text,
                match part {
                    Part::Header(name) => format!("header {name:?}"),
                    _ => "the message's key".to_owned(),
                },
                if missing.is_some() {
                    "an empty one"
                } else {
                    "none"
                }
            ),
        )),
    }
}

/// A value as one subject token: every byte of its UTF-8 but ASCII
/// letters, digits, `-` and `_` written `%XX` (upper-case hex). Any
/// percent-decoder reads the value back; a value of those characters alone
/// is its own token.
pub fn subject_token(value: &str) -> String {
    const KEPT_AS_IS: &percent_encoding::AsciiSet =
        &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'_');
    percent_encoding::utf8_percent_encode(value, KEPT_AS_IS).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields<'a>(key: Option<&'a str>, headers: &'a [(String, String)]) -> SubjectFields<'a> {
        SubjectFields {
            prefix: "outbox",
            message_type: "order.placed",
            key,
            headers,
        }
    }

    #[test]
    fn the_default_gives_prefix_and_type() {
        let template = SubjectTemplate::parse(DEFAULT_SUBJECT_TEMPLATE).expect("parses");
        assert_eq!(template, SubjectTemplate::default());
        let subject = template.render(&fields(None, &[])).expect("renders");
        assert_eq!(subject, "outbox.order.placed");
    }

    #[test]
    fn key_and_headers_are_one_token_each() {
        let template =
            SubjectTemplate::parse("{prefix}.{type}.{header.X-Tenant}.{key}").expect("parses");
        let headers = [("X-Tenant".to_owned(), "acme.eu".to_owned())];
        let subject = template
            .render(&fields(Some("o-1001"), &headers))
            .expect("renders");
        assert_eq!(subject, "outbox.order.placed.acme%2Eeu.o-1001");
        assert!(template.uses_key());
        assert_eq!(template.headers().collect::<Vec<_>>(), ["X-Tenant"]);
    }

    #[test]
    fn hostile_values_cannot_add_a_token_or_a_wildcard() {
        for (key, token) in [
            ("a.b", "a%2Eb"),
            ("sp ace", "sp%20ace"),
            ("*", "%2A"),
            (">", "%3E"),
            ("$JS.API", "%24JS%2EAPI"),
            ("\u{1}\n", "%01%0A"),
            ("Zürich", "Z%C3%BCrich"),
            ("50%", "50%25"),
            ("_INBOX", "_INBOX"),
        ] {
            assert_eq!(subject_token(key), token, "{key:?}");
            assert!(super::super::validate_subject(&format!("a.{token}")).is_ok());
        }
    }

    #[test]
    fn a_message_without_what_the_template_needs_is_refused() {
        let template = SubjectTemplate::parse("{prefix}.{key}.{header.h}").expect("parses");
        let headers = [("h".to_owned(), "v".to_owned())];
        for (key, headers, missing) in [
            (
                None,
                &headers[..],
                "the message's key, and the message has none",
            ),
            (
                Some(""),
                &headers[..],
                "the message's key, and the message has an empty one",
            ),
            (Some("k"), &[][..], "header \"h\", and the message has none"),
        ] {
            let violation = template.render(&fields(key, headers)).unwrap_err();
            assert_eq!(violation.rule(), Rule::SubjectTemplate);
            assert!(violation.to_string().contains(missing), "{violation}");
        }
    }

    #[test]
    fn templates_are_checked_when_read() {
        for (bad, why) in [
            ("{prefix}.o-{key}", "whole token"),
            ("{prefix}.{key}x", "whole token"),
            ("{prefix}{type}", "whole token"),
            ("{prefix}.{id}", "no placeholder"),
            ("{prefix}.{key", "never closed"),
            ("{prefix}.key}", "opens nothing"),
            ("{prefix}.{header.}", "cannot be a header"),
            ("{prefix}.{header.a:b}", "cannot be a header"),
            ("{prefix}.{header.Nats-Msg-Id}", "the relay's own"),
            ("{prefix}.{header.outbox-key}", "the relay's own"),
        ] {
            let error = SubjectTemplate::parse(bad).unwrap_err();
            assert!(error.contains(why), "{bad}: {error}");
        }
        for good in [
            "{key}",
            "orders.{type}.{key}",
            "a.b",
            "{prefix}.x.{header.a.b}",
        ] {
            assert!(SubjectTemplate::parse(good).is_ok(), "{good}");
        }
    }
}
