//! [`CachedEndpoints`]: the SDK's own endpoint resolver, its answers kept.
//!
//! The S3 SDK resolves the endpoint of every request twice (to choose the
//! auth scheme, then to send) by evaluating S3's endpoint rules: regular
//! expressions, URL parsing, partition tables. That is a fifth of the
//! client's instructions per HEAD. The answer is a function of the
//! request's endpoint parameters, and S3's rules read every parameter but
//! the object key; a tier asks about one bucket, so it sees a handful of
//! parameter sets, each kept with its answer ([`Route`]).

use std::sync::{PoisonError, RwLock};

use aws_sdk_s3::config::endpoint::{
    DefaultResolver, Endpoint, EndpointFuture, Params, ResolveEndpoint,
};

/// Most answers kept; past it the list starts afresh (a tier sees a handful).
const MAX_CACHED: usize = 16;

/// The SDK's [`DefaultResolver`], each answer kept by its parameters less
/// the object key. Errors are not kept.
#[derive(Debug)]
pub(crate) struct CachedEndpoints {
    rules: DefaultResolver,
    answers: RwLock<Vec<(Route, Endpoint)>>,
}

impl CachedEndpoints {
    pub(crate) fn new() -> Self {
        Self {
            rules: DefaultResolver::new(),
            answers: RwLock::new(Vec::new()),
        }
    }
}

impl ResolveEndpoint for CachedEndpoints {
    fn resolve_endpoint<'a>(&'a self, params: &'a Params) -> EndpointFuture<'a> {
        if let Some((_, known)) = self
            .answers
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .find(|(route, _)| route.matches(params))
        {
            return EndpointFuture::ready(Ok(known.clone()));
        }
        let resolving = self.rules.resolve_endpoint(params);
        EndpointFuture::new(async move {
            let endpoint = resolving.await?;
            let mut answers = self.answers.write().unwrap_or_else(PoisonError::into_inner);
            if answers.len() >= MAX_CACHED {
                answers.clear();
            }
            answers.push((Route::of(params), endpoint.clone()));
            Ok(endpoint)
        })
    }
}

/// Every endpoint parameter but the object key (`Params::key`), which
/// S3's rules do not read. A test checks that this lists every parameter
/// the SDK's `Params` has, so an SDK that adds one fails it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Route {
    bucket: Option<String>,
    region: Option<String>,
    endpoint: Option<String>,
    prefix: Option<String>,
    copy_source: Option<String>,
    flags: [Option<bool>; Route::FLAGS],
}

impl Route {
    /// The boolean parameters, in the order of [`Route::flags_of`].
    const FLAGS: usize = 11;

    fn flags_of(params: &Params) -> [Option<bool>; Route::FLAGS] {
        [
            params.use_fips(),
            params.use_dual_stack(),
            params.force_path_style(),
            params.accelerate(),
            params.use_global_endpoint(),
            params.use_object_lambda_endpoint(),
            params.disable_access_points(),
            params.disable_multi_region_access_points(),
            params.use_arn_region(),
            params.use_s3_express_control_endpoint(),
            params.disable_s3_express_session_auth(),
        ]
    }

    fn of(params: &Params) -> Self {
        Self {
            bucket: params.bucket().map(str::to_owned),
            region: params.region().map(str::to_owned),
            endpoint: params.endpoint().map(str::to_owned),
            prefix: params.prefix().map(str::to_owned),
            copy_source: params.copy_source().map(str::to_owned),
            flags: Self::flags_of(params),
        }
    }

    /// Whether `params` has this route's parameters (its key aside), without
    /// copying any of them.
    fn matches(&self, params: &Params) -> bool {
        self.bucket.as_deref() == params.bucket()
            && self.region.as_deref() == params.region()
            && self.endpoint.as_deref() == params.endpoint()
            && self.prefix.as_deref() == params.prefix()
            && self.copy_source.as_deref() == params.copy_source()
            && self.flags == Self::flags_of(params)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(endpoint: Option<&str>, path_style: bool, key: Option<&str>) -> Params {
        Params::builder()
            .bucket("kv-cache")
            .region("eu-west-1")
            .set_endpoint(endpoint.map(str::to_owned))
            .force_path_style(path_style)
            .set_key(key.map(str::to_owned))
            .build()
            .unwrap()
    }

    fn resolve(resolver: &impl ResolveEndpoint, params: &Params) -> Endpoint {
        ready(resolver.resolve_endpoint(params)).unwrap()
    }

    /// The resolver's futures do no I/O; runs one.
    fn ready<T>(future: impl std::future::Future<Output = T>) -> T {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        runtime.block_on(future)
    }

    #[test]
    fn answers_are_the_sdks_and_do_not_depend_on_the_object_key() {
        let rules = DefaultResolver::new();
        let cached = CachedEndpoints::new();
        for (endpoint, path_style) in [
            (Some("http://127.0.0.1:9000"), true),
            (Some("https://minio.example.com"), false),
            (None, false),
            (None, true),
        ] {
            let keyless = params(endpoint, path_style, None);
            for key in [
                None,
                Some("kvtier/00ff"),
                Some("a\"b\\c)d, key: x"),
                Some(""),
            ] {
                let with_key = params(endpoint, path_style, key);
                let sdk = resolve(&rules, &with_key);
                // S3's rules give the same endpoint whatever the key.
                assert_eq!(sdk, resolve(&rules, &keyless), "{with_key:?}");
                // Asked twice: computed, then kept; both the SDK's answer.
                assert_eq!(resolve(&cached, &with_key), sdk, "{with_key:?}");
                assert_eq!(resolve(&cached, &with_key), sdk, "{with_key:?}");
            }
        }
        // One answer per endpoint configuration, none per key.
        assert_eq!(cached.answers.read().unwrap().len(), 4);
    }

    /// `Route` holds 5 strings and `Route::FLAGS` flags, plus the key it
    /// leaves out: every field of the SDK's `Params` (counted in its
    /// `Debug` form). An SDK that adds a parameter fails here, before a
    /// cached answer could ignore it.
    #[test]
    fn a_route_covers_every_endpoint_parameter_but_the_key() {
        let shown = format!("{:?}", params(None, true, Some("k")));
        let fields = shown.matches(": ").count();
        assert_eq!(fields, 5 + Route::FLAGS + 1, "{shown}");
        let route = Route::of(&params(Some("http://h:1"), true, Some("a")));
        assert!(route.matches(&params(Some("http://h:1"), true, Some("b"))));
        assert!(route.matches(&params(Some("http://h:1"), true, None)));
        assert!(!route.matches(&params(Some("http://h:2"), true, Some("a"))));
        assert!(!route.matches(&params(Some("http://h:1"), false, Some("a"))));
    }
}
