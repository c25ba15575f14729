//! What the SDK may log: the program's own subscriber, less the SDK's
//! TRACE lines that print a whole request, headers and all (the session
//! token is a header).
//!
//! At TRACE, `aws_sigv4` prints each canonical request and
//! `aws_smithy_runtime::client::orchestrator` each request it transmits,
//! `x-amz-security-token` included. Every request of a tier runs under
//! [`SdkLogs::scope`], which hands the SDK a subscriber that forwards all
//! but those lines to the one in effect. Nothing else changes: every other
//! line of the SDK, at every level, reaches the program's subscriber.

use std::future::Future;
use std::sync::OnceLock;

use tracing::instrument::WithSubscriber;
use tracing::level_filters::LevelFilter;
use tracing::subscriber::{Interest, NoSubscriber, Subscriber};
use tracing::{Dispatch, Event, Level, Metadata, span};

/// Targets whose TRACE lines print a request's headers.
const REQUEST_DUMPS: [&str; 2] = ["aws_sigv4", "aws_smithy_runtime::client::orchestrator"];

/// Whether `metadata` is one of the lines [`SdkLogs`] holds back.
fn dumps_a_request(metadata: &Metadata<'_>) -> bool {
    *metadata.level() == Level::TRACE
        && REQUEST_DUMPS.iter().any(|target| {
            metadata
                .target()
                .strip_prefix(target)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with("::"))
        })
}

/// The subscriber a tier's requests run under (see the module docs), made
/// the first time a request finds a subscriber to forward to.
#[derive(Debug, Default)]
pub(crate) struct SdkLogs {
    filtered: OnceLock<Dispatch>,
}

impl SdkLogs {
    /// `request`, run under the program's subscriber less the SDK's
    /// request dumps. Made on the thread that polls it, so the subscriber
    /// is the one in effect there (the global one on the tier's runtime).
    pub(crate) async fn scope<F: Future>(&self, request: F) -> F::Output {
        match self.dispatch() {
            Some(dispatch) => request.with_subscriber(dispatch).await,
            None => request.await,
        }
    }

    /// The filtering subscriber; `None` while no subscriber is installed
    /// (nothing would be logged, and one installed later is found then).
    fn dispatch(&self) -> Option<Dispatch> {
        if let Some(dispatch) = self.filtered.get() {
            return Some(dispatch.clone());
        }
        let current = tracing::dispatcher::get_default(Dispatch::clone);
        if current.is::<NoSubscriber>() {
            return None;
        }
        // Registering a subscriber rebuilds every callsite's interest:
        // once per tier, not per request.
        Some(
            self.filtered
                .get_or_init(|| Dispatch::new(HoldBackRequestDumps::new(current)))
                .clone(),
        )
    }
}

/// Forwards everything to `inner` but the lines of [`dumps_a_request`].
struct HoldBackRequestDumps {
    inner: Dispatch,
    /// The most verbose level enabled anywhere when this was made (the
    /// inner subscriber's own hint is not public): a hint, so that this
    /// subscriber never turns on levels nobody listens to.
    max_level: LevelFilter,
}

impl HoldBackRequestDumps {
    fn new(inner: Dispatch) -> Self {
        Self {
            inner,
            max_level: LevelFilter::current(),
        }
    }
}

impl Subscriber for HoldBackRequestDumps {
    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        if dumps_a_request(metadata) {
            Interest::never()
        } else {
            self.inner.register_callsite(metadata)
        }
    }

    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        !dumps_a_request(metadata) && self.inner.enabled(metadata)
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(self.max_level)
    }

    fn new_span(&self, span: &span::Attributes<'_>) -> span::Id {
        self.inner.new_span(span)
    }

    fn record(&self, span: &span::Id, values: &span::Record<'_>) {
        self.inner.record(span, values);
    }

    fn record_follows_from(&self, span: &span::Id, follows: &span::Id) {
        self.inner.record_follows_from(span, follows);
    }

    fn event(&self, event: &Event<'_>) {
        if !dumps_a_request(event.metadata()) {
            self.inner.event(event);
        }
    }

    fn enter(&self, span: &span::Id) {
        self.inner.enter(span);
    }

    fn exit(&self, span: &span::Id) {
        self.inner.exit(span);
    }

    fn clone_span(&self, id: &span::Id) -> span::Id {
        self.inner.clone_span(id)
    }

    fn try_close(&self, id: span::Id) -> bool {
        self.inner.try_close(id)
    }

    fn current_span(&self) -> tracing_core::span::Current {
        self.inner.current_span()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_request_dumps_are_held_back() {
        use tracing::callsite::Identifier;
        use tracing::field::FieldSet;
        use tracing::metadata::Kind;

        struct Site;
        impl tracing::callsite::Callsite for Site {
            fn set_interest(&self, _: Interest) {}
            fn metadata(&self) -> &Metadata<'_> {
                unreachable!()
            }
        }
        static SITE: Site = Site;
        let meta = |target: &'static str, level| {
            Metadata::new(
                "event",
                target,
                level,
                None,
                None,
                None,
                FieldSet::new(&[], Identifier(&SITE)),
                Kind::EVENT,
            )
        };
        for (target, level, held) in [
            ("aws_sigv4::http_request::sign", Level::TRACE, true),
            ("aws_sigv4", Level::TRACE, true),
            (
                "aws_smithy_runtime::client::orchestrator",
                Level::TRACE,
                true,
            ),
            ("aws_sigv4::http_request::sign", Level::DEBUG, false),
            (
                "aws_smithy_runtime::client::orchestrator",
                Level::DEBUG,
                false,
            ),
            (
                "aws_smithy_runtime::client::orchestrator::endpoints",
                Level::TRACE,
                true,
            ),
            ("aws_smithy_runtime::client::retries", Level::TRACE, false),
            ("aws_sigv4a", Level::TRACE, false),
            ("hyper_util::client::legacy::pool", Level::TRACE, false),
            ("kvtier_s3", Level::TRACE, false),
        ] {
            assert_eq!(
                dumps_a_request(&meta(target, level)),
                held,
                "{target} {level}"
            );
        }
    }
}
