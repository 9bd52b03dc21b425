//! TEMPORARY stub, replaced by the textcore branch.
#[derive(Debug, thiserror::Error)]
#[error("bad glob")]
pub struct GlobError;
pub struct SessionGlob(String);
impl SessionGlob {
    pub fn parse(s: &str) -> Result<Self, GlobError> {
        Ok(SessionGlob(s.to_string()))
    }
    pub fn matches(&self, key: &str) -> bool {
        self.0 == key || self.0 == "**"
    }
    pub fn specificity(&self) -> u32 {
        self.0.len() as u32
    }
}
